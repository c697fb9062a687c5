// The generic kernel before a rule's math: a gradient's rows coalesced and the
// rows of any number of tables gathered at them, in one pass, for any rule and
// any table dtype (`kernels.coalesce_and_gather`). The rule's math then runs as
// XLA ops on the gathered block, and the generic store (`row_store.cc`) writes
// its rows back in place: no per-rule C++.
//
// XLA:CPU sorts, searches and gathers element by element; this sorts the rows
// (`ffi_common.h`'s stable radix sort), sums each row's entries in input order
// from -0.0, each add rounded to the gradient's dtype (float32, bfloat16 or float16), as
// `coalesce.coalesce_and_gather_rows` sums them, and copies each
// table's row bytes at each distinct row, zeros at padding slots (as
// `bcoo.gather_rows` fills them): XLA's bits by construction.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

// `out` = `x` (16-bit values held in float32) as their bits: exact.
OSA_MULTIVERSIONED void ToBitsRow(uint16_t* __restrict__ out, const float* __restrict__ x,
                                  int64_t row_size) {
  for (int64_t j = 0; j < row_size; ++j) out[j] = Bf16Bits<false>(x[j], 0);
}
void ToBitsRow(Float16* out, const float* x, int64_t row_size) {
  NarrowF16Row(reinterpret_cast<uint16_t*>(out), x, row_size);
}

struct GatheredTable {
  const char* rows;  // the table, `num_rows` rows of `row_bytes`
  char* out;         // `nse` rows of `row_bytes`
  int64_t row_bytes;
};

// Each distinct row's entries summed in input order from -0.0, every add rounded
// to the values' dtype T (float32, bfloat16 bits or `Float16`: as XLA adds 16-bit
// floats), and every table's row gathered.
template <typename T>
void CoalesceGather(const int32_t* rows, int64_t nse, const T* values, int64_t num_rows,
                    int64_t row_size, const std::vector<GatheredTable>& tables,
                    ffi::ThreadPool& pool, int32_t* out_rows, T* sums) {
  constexpr bool kWide = std::is_same_v<T, float>;
  // One scratch row per thread for 16-bit sums (float32 ones go to the output).
  thread_local std::vector<float> scratch;
  const int64_t num_unique = ForEachCoalescedRow(
      rows, nse, num_rows, row_size, pool, out_rows,
      [&](int64_t ahead, const uint32_t* position, int64_t begin, int64_t end) {
        for (const GatheredTable& t : tables) {
          PrefetchRow(t.rows + ahead * t.row_bytes, t.row_bytes);
        }
        PrefetchEntries(values, position, begin, end, row_size);
      },
      [&](int64_t s, int64_t row, const uint32_t* position, int64_t begin, int64_t end) {
        if constexpr (kWide) {
          SumEntries(sums + s * row_size, values, position, begin, end, row_size);
        } else {
          if (static_cast<int64_t>(scratch.size()) < row_size) scratch.resize(row_size);
          SumEntries(scratch.data(), values, position, begin, end, row_size);
          ToBitsRow(sums + s * row_size, scratch.data(), row_size);
        }
        for (const GatheredTable& t : tables) {
          std::memcpy(t.out + s * t.row_bytes, t.rows + row * t.row_bytes, t.row_bytes);
        }
      });
  // Padding slots: out of range, zeros.
  std::memset(sums + num_unique * row_size, 0, sizeof(T) * (nse - num_unique) * row_size);
  for (const GatheredTable& t : tables) {
    std::memset(t.out + num_unique * t.row_bytes, 0, (nse - num_unique) * t.row_bytes);
  }
}

ffi::Error CoalesceGatherImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                              ffi::RemainingArgs tables, int64_t num_rows, ffi::ThreadPool pool,
                              ffi::Result<ffi::Buffer<ffi::S32>> out_rows,
                              ffi::Result<ffi::AnyBuffer> out_values,
                              ffi::RemainingRets gathered) {
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const int64_t count = static_cast<int64_t>(values.element_count());
  const int64_t row_size = nse == 0 ? 0 : count / nse;
  if (nse == 0 || row_size == 0 || row_size * nse != count) {
    return ffi::Error::InvalidArgument("values must hold nse > 0 rows of at least one value");
  }
  const ffi::DataType type = values.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("values must be float32, bfloat16 or float16");
  }
  if (num_rows <= 0 || tables.size() != gathered.size() || out_values->element_type() != type) {
    return ffi::Error::InvalidArgument("one gathered output per table, num_rows > 0");
  }
  std::vector<GatheredTable> ts;
  for (size_t k = 0; k < tables.size(); ++k) {
    auto table = tables.get<ffi::AnyBuffer>(k);
    auto out = gathered.get<ffi::AnyBuffer>(k);
    if (!table.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("tables and outputs must be buffers");
    }
    if (RowSize(table->element_count(), num_rows) < 0) {
      return ffi::Error::InvalidArgument("each table must hold num_rows rows");
    }
    const int64_t row_bytes = static_cast<int64_t>(table->size_bytes()) / num_rows;
    if (static_cast<int64_t>((*out)->size_bytes()) != nse * row_bytes) {
      return ffi::Error::InvalidArgument("each output must hold nse rows of its table");
    }
    ts.push_back({static_cast<const char*>(table->untyped_data()),
                  static_cast<char*>((*out)->untyped_data()), row_bytes});
  }
  const int32_t* r = rows.typed_data();
  const void* v = values.untyped_data();
  int32_t* rows_out = out_rows->typed_data();
  void* sums = out_values->untyped_data();
  if (type == ffi::DataType::F32) {
    CoalesceGather(r, nse, static_cast<const float*>(v), num_rows, row_size, ts, pool, rows_out,
                   static_cast<float*>(sums));
  } else if (type == ffi::DataType::BF16) {
    CoalesceGather(r, nse, static_cast<const uint16_t*>(v), num_rows, row_size, ts, pool,
                   rows_out, static_cast<uint16_t*>(sums));
  } else {
    CoalesceGather(r, nse, static_cast<const Float16*>(v), num_rows, row_size, ts, pool,
                   rows_out, static_cast<Float16*>(sums));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaCoalesceGather, CoalesceGatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("num_rows")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets());
