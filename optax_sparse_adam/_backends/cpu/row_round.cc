// Generic kernels for 16-bit tables (bfloat16, float16): a row's new value
// `round(table[row] + delta)`, computed in float32 and rounded once to the
// table's dtype, to nearest (ties to even) or stochastically
// (`rounding.stochastic_round` with the parameter's bits, `PARAM_SLOT`), reading
// and writing 2 bytes a value where the XLA ops gather, convert and store:
//
// - `OsaAddRoundedRows` (`row_round.add_rounded_rows`): the rows a step sets,
//   `round(table[rows] + delta)`, zeros at padding (`xla.rounded_param_rows`);
// - `OsaAddRowsInPlace` (`row_round.add_rows_in_place`): the apply
//   `table[rows] += values` in place, each value first cast to the table's dtype
//   and each distinct row's entries added in float32 in input order, rounded
//   once (`xla.scatter_add`'s bfloat16 path) or at every add (XLA's float16
//   scatter-add).
//
// No rule's math: the same bits as the XLA ops by construction
// (tests/backends/test_row_round.py).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"
#include "row_round.h"
#include "xla/ffi/api/ffi.h"

namespace {

ffi::Error CheckTable(const ffi::AnyBuffer& table, int64_t num_rows, int64_t* row_size) {
  const ffi::DataType type = table.element_type();
  if (type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("table must be bfloat16 or float16");
  }
  *row_size = RowSize(table.element_count(), num_rows);
  if (*row_size <= 0) return ffi::Error::InvalidArgument("table must hold num_rows rows");
  return ffi::Error::Success();
}

template <bool kF16, bool kStochastic>
void AddRoundedRows(ffi::ThreadPool& pool, const int32_t* rows, int64_t nse, const float* delta,
                    const uint16_t* table, int64_t num_rows, int64_t row_size, uint32_t key,
                    uint32_t row_offset, uint16_t* out) {
  for (int64_t i = 0; i < nse; ++i) {  // padding (out of range): zeros
    if (rows[i] < 0 || rows[i] >= num_rows) std::memset(out + i * row_size, 0, 2 * row_size);
  }
  ForEachEntryRow(
      pool, rows, nse, num_rows, row_size, /*rows_unique=*/true,
      [&](int64_t row) { PrefetchRow(table + row * row_size, row_size); },
      [&](int64_t i, int64_t row) {
        const uint32_t row_key = RowKey(key, static_cast<uint32_t>(row) + row_offset);
        AddRoundRow<kF16, kStochastic>(out + i * row_size, table + row * row_size,
                                       delta + i * row_size, row_size, row_key);
      });
}

// rows s32 (nse,) distinct in range, delta f32 (nse, row_size), table bf16/f16,
// keys u32 (2,): the parameter's step key and the table's first global row.
ffi::Error AddRoundedRowsImpl(ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> delta,
                              ffi::AnyBuffer table, ffi::Buffer<ffi::U32> keys, int64_t num_rows,
                              bool stochastic, ffi::ThreadPool pool,
                              ffi::Result<ffi::AnyBuffer> out) {
  int64_t row_size = 0;
  if (ffi::Error error = CheckTable(table, num_rows, &row_size); error.failure()) return error;
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  if (static_cast<int64_t>(delta.element_count()) != nse * row_size ||
      static_cast<int64_t>(out->element_count()) != nse * row_size ||
      out->element_type() != table.element_type() || keys.element_count() != 2) {
    return ffi::Error::InvalidArgument("delta and out must hold nse rows; keys (2,)");
  }
  const bool f16 = table.element_type() == ffi::DataType::F16;
  auto* o = static_cast<uint16_t*>(out->untyped_data());
  const auto* t = static_cast<const uint16_t*>(table.untyped_data());
  const uint32_t key = keys.typed_data()[0], offset = keys.typed_data()[1];
  auto run = [&](auto f16_tag, auto stochastic_tag) {
    AddRoundedRows<decltype(f16_tag)::value, decltype(stochastic_tag)::value>(
        pool, rows.typed_data(), nse, delta.typed_data(), t, num_rows, row_size, key, offset, o);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (f16) {
    stochastic ? run(T{}, T{}) : run(T{}, F{});
  } else {
    stochastic ? run(F{}, T{}) : run(F{}, F{});
  }
  return ffi::Error::Success();
}

// An entry's value cast to the table's dtype (to nearest), widened to float32.
template <bool kF16, typename V>
inline float EntryValue(V v) {
  if constexpr (std::is_same_v<V, float>) return Widen<kF16>(Nearest<kF16>(v));
  return Widen<kF16>(v);
}

// `p = round(p + v)`: one entry added to a row in place.
template <bool kF16, typename V>
OSA_MULTIVERSIONED_TEMPLATE void AddEntryInPlaceBf16(uint16_t* __restrict__ p,
                                                     const V* __restrict__ v, int64_t row_size) {
  for (int64_t j = 0; j < row_size; ++j) {
    p[j] = Nearest<kF16>(Widen<kF16>(p[j]) + EntryValue<kF16>(v[j]));
  }
}

// `out` = the entry `v` as float16 values, in float32 (cast to float16 first).
template <typename V>
void F16EntryRow(float* out, const V* v, int64_t row_size) {
  if constexpr (std::is_same_v<V, float>) {
    thread_local std::vector<uint16_t> narrow;
    if (static_cast<int64_t>(narrow.size()) < row_size) narrow.resize(row_size);
    NarrowF16Row(narrow.data(), v, row_size);
    WidenF16Row(out, narrow.data(), row_size);
  } else {
    WidenF16Row(out, v, row_size);
  }
}

template <bool kF16, typename V>
void AddEntryInPlace(uint16_t* p, const V* v, int64_t row_size) {
  if constexpr (!kF16) {
    AddEntryInPlaceBf16<false>(p, v, row_size);
  } else {
    float* a = Scratch(0, row_size);
    float* b = Scratch(1, row_size);
    WidenF16Row(a, p, row_size);
    F16EntryRow(b, v, row_size);
    AddRow16(a, b, row_size);
    NarrowF16Row(p, a, row_size);
  }
}

// `acc += v`, rounded to the table's dtype where `round_each_add`.
template <bool kF16, typename V>
OSA_MULTIVERSIONED_TEMPLATE void AddEntry(float* __restrict__ acc, const V* __restrict__ v,
                                          int64_t row_size, bool round_each_add) {
  for (int64_t j = 0; j < row_size; ++j) {
    const float sum = acc[j] + EntryValue<kF16>(v[j]);
    acc[j] = round_each_add ? Widen<kF16>(Nearest<kF16>(sum)) : sum;
  }
}

template <bool kF16, typename V>
void AddRowsInPlace(ffi::ThreadPool& pool, const int32_t* rows, int64_t nse, const V* values,
                    uint16_t* table, int64_t num_rows, int64_t row_size, bool rows_unique,
                    bool round_each_add) {
  auto prefetch = [&](int64_t row) { PrefetchRow(table + row * row_size, row_size); };
  if (rows_unique) {
    ForEachEntryRow(pool, rows, nse, num_rows, row_size, true, prefetch,
                    [&](int64_t i, int64_t row) {
                      AddEntryInPlace<kF16>(table + row * row_size, values + i * row_size,
                                            row_size);
                    });
    return;
  }
  // Repeated rows: each distinct row's entries in input order (`ForEachCoalescedRow`),
  // summed in a float32 row.
  std::vector<int32_t> distinct(nse);
  ForEachCoalescedRow(
      rows, nse, num_rows, row_size, pool, distinct.data(),
      [&](int64_t row, const uint32_t* position, int64_t begin, int64_t end) {
        prefetch(row);
        PrefetchEntries(values, position, begin, end, row_size);
      },
      [&](int64_t, int64_t row, const uint32_t* position, int64_t begin, int64_t end) {
        uint16_t* p = table + row * row_size;
        if (end - begin == 1) {
          AddEntryInPlace<kF16>(p, values + position[begin] * row_size, row_size);
          return;
        }
        thread_local std::vector<float> acc;
        if (static_cast<int64_t>(acc.size()) < row_size) acc.resize(row_size);
        if constexpr (kF16) {
          // Each add rounded to float16 (XLA's float16 scatter-add): an entry at a time.
          for (int64_t e = begin; e < end; ++e) {
            AddEntryInPlace<true>(p, values + position[e] * row_size, row_size);
          }
          return;
        }
        for (int64_t j = 0; j < row_size; ++j) acc[j] = Widen<kF16>(p[j]);
        for (int64_t e = begin; e < end; ++e) {
          AddEntry<kF16>(acc.data(), values + position[e] * row_size, row_size, round_each_add);
        }
        for (int64_t j = 0; j < row_size; ++j) p[j] = Nearest<kF16>(acc[j]);
      });
}

// rows s32 (nse,), values (nse, row_size) f32 or the table's dtype, table bf16/f16
// (aliased to the output): `table[rows] += values`, out-of-range rows dropped.
ffi::Error AddRowsInPlaceImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                              ffi::AnyBuffer table, int64_t num_rows, bool rows_unique,
                              bool round_each_add, ffi::ThreadPool pool,
                              ffi::Result<ffi::AnyBuffer> out) {
  int64_t row_size = 0;
  if (ffi::Error error = CheckTable(table, num_rows, &row_size); error.failure()) return error;
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const bool wide = values.element_type() == ffi::DataType::F32;
  if ((!wide && values.element_type() != table.element_type()) ||
      static_cast<int64_t>(values.element_count()) != nse * row_size) {
    return ffi::Error::InvalidArgument("values must be nse rows, float32 or the table's dtype");
  }
  CopyIfNotAliased(table, out);
  auto* t = static_cast<uint16_t*>(out->untyped_data());
  const void* v = values.untyped_data();
  auto run = [&](auto f16_tag, const auto* typed) {
    AddRowsInPlace<decltype(f16_tag)::value>(pool, rows.typed_data(), nse, typed, t, num_rows,
                                             row_size, rows_unique, round_each_add);
  };
  const bool f16 = table.element_type() == ffi::DataType::F16;
  const auto* wide_values = static_cast<const float*>(v);
  const auto* narrow_values = static_cast<const uint16_t*>(v);
  if (f16) {
    wide ? run(std::true_type{}, wide_values) : run(std::true_type{}, narrow_values);
  } else {
    wide ? run(std::false_type{}, wide_values) : run(std::false_type{}, narrow_values);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaAddRoundedRows, AddRoundedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Attr<bool>("stochastic")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaAddRowsInPlace, AddRowsInPlaceImpl,
                              RowsIntoTableBinding()
                                  .Attr<bool>("round_each_add")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::AnyBuffer>());
