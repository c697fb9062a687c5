// The generic kernel before a rule's math: a gradient's rows coalesced and the
// rows of any number of tables gathered at them, in one pass, for any rule and
// any table dtype (`kernels.coalesce_and_gather`). The rule's math then runs as
// XLA ops on the gathered block, and the generic store (`row_store.cc`) writes
// its rows back in place: no per-rule C++.
//
// XLA:CPU sorts, searches and gathers element by element; this sorts the rows
// (`ffi_common.h`'s stable radix sort), sums each row's entries in input order
// from +0.0, each add rounded to the gradient's dtype (float32, bfloat16 or
// float16), as `coalesce.coalesce_and_gather_rows` sums them, and copies each
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

// float16 <-> float32, rounded to nearest even, NaN made quiet (as XLA converts).
// Branch-free (every case computed, one selected; int32 compares, which AVX2
// has), so the row loops vectorize.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int32_t magnitude = h & 0x7FFF;
  const uint32_t normal = (static_cast<uint32_t>(magnitude) << 13) + 0x38000000u;
  const uint32_t inf_nan = 0x7F800000u | (static_cast<uint32_t>(magnitude & 0x3FF) << 13);
  // A subnormal is an exact product.
  const uint32_t subnormal = Bits(static_cast<float>(magnitude) * 5.9604644775390625e-8f);
  const uint32_t word = magnitude >= 0x7C00 ? inf_nan : (magnitude < 0x400 ? subnormal : normal);
  return WithBits(sign | word);
}
inline uint16_t FloatToHalf(float x) {
  const uint32_t bits = Bits(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t word = bits & 0x7FFFFFFFu;
  const int32_t magnitude = static_cast<int32_t>(word);
  // Normal: rebias the exponent and round to nearest even (a carry may reach inf).
  const uint32_t normal = (word + 0xC8000FFFu + ((word >> 13) & 1u)) >> 13;
  // Below 2^-14: the FPU rounds the subnormal (0.5's ulp is float16's smallest).
  const uint32_t subnormal = Bits(WithBits(word) + 0.5f) - 0x3F000000u;
  // 2^16 and above: inf, or NaN (made quiet).
  const uint32_t inf_nan = magnitude > 0x7F800000 ? 0x7E00u | ((word >> 13) & 0x3FFu) : 0x7C00u;
  const uint32_t half =
      magnitude >= 0x47800000 ? inf_nan : (magnitude < 0x38800000 ? subnormal : normal);
  return static_cast<uint16_t>(half | sign);
}

// The gradient's values, as float32, and their sums rounded to the values' dtype.
enum ValueType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
template <int kType>
inline float Load(const void* values, int64_t i) {
  if constexpr (kType == kF32) return static_cast<const float*>(values)[i];
  const uint16_t bits = static_cast<const uint16_t*>(values)[i];
  if constexpr (kType == kBF16) return ToFloat(bits);
  return HalfToFloat(bits);
}
template <int kType>
inline float Rounded(float x) {
  if constexpr (kType == kF32) return x;
  if constexpr (kType == kBF16) return ToFloat(Bf16Bits<false>(x, 0));
  return HalfToFloat(FloatToHalf(x));
}
template <int kType>
inline void Store(void* out, int64_t i, float x) {
  if constexpr (kType == kF32) {
    static_cast<float*>(out)[i] = x;
  } else if constexpr (kType == kBF16) {
    static_cast<uint16_t*>(out)[i] = Bf16Bits<false>(x, 0);
  } else {
    static_cast<uint16_t*>(out)[i] = FloatToHalf(x);
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
    CoalesceGather<kF32>(r, nse, v, num_rows, row_size, ts, pool, rows_out, sums);
  } else if (type == ffi::DataType::BF16) {
    CoalesceGather<kBF16>(r, nse, v, num_rows, row_size, ts, pool, rows_out, sums);
  } else {
    CoalesceGather<kF16>(r, nse, v, num_rows, row_size, ts, pool, rows_out, sums);
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
