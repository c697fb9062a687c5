// The generic kernel before a rule's math: a gradient's rows coalesced and the
// rows of any number of tables gathered at them, in one pass, for any rule and
// any table dtype (`kernels.coalesce_and_gather`). The rule's math then runs as
// XLA ops on the gathered block, and the generic store (`row_store.cc`) writes
// its rows back in place: no per-rule C++.
//
// XLA:CPU sorts, searches and gathers element by element; this sorts the rows
// (`ffi_common.h`'s stable radix sort), sums each row's entries in input order
// from +0.0, each add rounded to the gradient's dtype (float32 or bfloat16), as
// `coalesce.coalesce_and_gather_rows` sums them, and copies each
// table's row bytes at each distinct row, zeros at padding slots (as
// `bcoo.gather_rows` fills them): XLA's bits by construction.

#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

struct GatheredTable {
  const char* rows;  // the table, `num_rows` rows of `row_bytes`
  char* out;         // `nse` rows of `row_bytes`
  int64_t row_bytes;
};

// The gradient's values, as float32, and their sums rounded to the values' dtype
// (float16 gradients are coalesced by XLA, whose conversions use the CPU's F16C).
enum ValueType : int { kF32 = 0, kBF16 = 1 };
template <int kType>
inline float Load(const void* values, int64_t i) {
  if constexpr (kType == kF32) return static_cast<const float*>(values)[i];
  return ToFloat(static_cast<const uint16_t*>(values)[i]);
}
template <int kType>
inline float Rounded(float x) {
  if constexpr (kType == kF32) return x;
  return ToFloat(Bf16Bits<false>(x, 0));
}
template <int kType>
inline void Store(void* out, int64_t i, float x) {
  if constexpr (kType == kF32) {
    static_cast<float*>(out)[i] = x;
  } else {
    static_cast<uint16_t*>(out)[i] = Bf16Bits<false>(x, 0);
  }
}

// Each distinct row's entries summed in input order from +0.0, every add rounded
// to the values' dtype (as XLA adds 16-bit floats), and every table's row gathered.
template <int kType>
void CoalesceGather(const int32_t* rows, int64_t nse, const void* values, int64_t num_rows,
                    int64_t row_size, const std::vector<GatheredTable>& tables,
                    ffi::ThreadPool& pool, int32_t* out_rows, void* sums) {
  std::vector<uint32_t> sorted_rows, position;
  const int64_t n = SortRows(rows, nse, num_rows, sorted_rows, position);
  const std::vector<int64_t> starts = RunStarts(sorted_rows, n);
  const int64_t num_unique = static_cast<int64_t>(starts.size()) - 1;
  const int64_t num_chunks = std::max<int64_t>(
      1, std::min<int64_t>(num_unique, kChunksPerThread * (pool.num_threads() + 1)));
  auto run_chunk = [&](int64_t chunk) {
    std::vector<float> acc(row_size);
    const int64_t begin = num_unique * chunk / num_chunks;
    const int64_t end = num_unique * (chunk + 1) / num_chunks;
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchRows < end) {
        const int64_t ahead = sorted_rows[starts[s + kPrefetchRows]];
        for (const GatheredTable& t : tables) {
          PrefetchRow(t.rows + ahead * t.row_bytes, t.row_bytes);
        }
      }
      const int64_t row = sorted_rows[starts[s]];
      out_rows[s] = static_cast<int32_t>(row);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t e = starts[s]; e < starts[s + 1]; ++e) {
        const int64_t first = static_cast<int64_t>(position[e]) * row_size;
        for (int64_t j = 0; j < row_size; ++j) {
          acc[j] = Rounded<kType>(acc[j] + Load<kType>(values, first + j));
        }
      }
      for (int64_t j = 0; j < row_size; ++j) Store<kType>(sums, s * row_size + j, acc[j]);
      for (const GatheredTable& t : tables) {
        std::memcpy(t.out + s * t.row_bytes, t.rows + row * t.row_bytes, t.row_bytes);
      }
    }
  };
  ParallelFor(pool, num_chunks, num_unique * row_size, run_chunk);
  for (int64_t s = num_unique; s < nse; ++s) {  // padding slots: out of range, zeros
    out_rows[s] = static_cast<int32_t>(num_rows + s);
    for (int64_t j = 0; j < row_size; ++j) Store<kType>(sums, s * row_size + j, 0.0f);
    for (const GatheredTable& t : tables) std::memset(t.out + s * t.row_bytes, 0, t.row_bytes);
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
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("values must be float32 or bfloat16");
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
    CoalesceGather<kF32>(r, nse, v, num_rows, row_size, ts, pool, rows_out, sums);
  } else {
    CoalesceGather<kBF16>(r, nse, v, num_rows, row_size, ts, pool, rows_out, sums);
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
