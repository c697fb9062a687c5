// What the fused CPU kernels share (`kernels.cc`: Adam, row-wise Adam; `rule_kernels.cc`:
// SGD, Adagrad, row-wise Adagrad): coalescing a gradient's rows (a stable radix
// sort, then one pass over the distinct rows, in parallel on XLA's pool), slot
// storage in float32 or bfloat16 (to nearest or stochastically), and the row
// sums in `rowwise_adam.pairwise_row_sum`'s order. Each source file that
// includes it gets its own copy (an anonymous namespace): the FFI handlers are
// the only exported symbols. A function here that some file does not call is
// `inline` (or a template): a file builds without unused-function warnings.

#ifndef OPTAX_SPARSE_ADAM_BACKENDS_CPU_FFI_COMMON_H_
#define OPTAX_SPARSE_ADAM_BACKENDS_CPU_FFI_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

// x86-64 Linux builds carry an x86-64-v3 clone (AVX2 and FMA) of the row loops,
// picked at load time;
// elsewhere the compiler's baseline ISA is used.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define OSA_MULTIVERSIONED __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define OSA_MULTIVERSIONED
#endif
// Clang cannot clone templates; there the row templates keep the baseline ISA.
#if defined(__clang__)
#define OSA_MULTIVERSIONED_TEMPLATE
#else
#define OSA_MULTIVERSIONED_TEMPLATE OSA_MULTIVERSIONED
#endif

namespace {

// Rows prefetched ahead of the one being updated: enough loads in flight to
// hide DRAM latency on random rows, few enough to stay in L2.
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kBytesPerLine = 64;

// Prefetches the cache line holding `p` (on x86-64 into L2, `prefetcht1`: the
// random rows of a step are bound by the core's outstanding misses, and a
// prefetch into L1 holds a fill buffer until its line arrives; into L2, the row
// loops over 2 to 4 tables of 1M rows measured 20-25% faster on the 2-core VM of
// docs/performance). An asm statement, not the builtin: GCC counts the builtin
// as free of side effects, so a function (a lambda) that only prefetches is
// found pure and its calls are deleted as dead before it is inlined; the Adam
// step had lost its prefetches so.
inline void PrefetchLine(const void* p) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm volatile("prfm pstl1keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 1);
#endif
}

template <typename T>
inline void PrefetchRow(const T* row, int64_t row_size) {
  constexpr int64_t kPerLine = kBytesPerLine / sizeof(T);
  for (int64_t j = 0; j < row_size; j += kPerLine) PrefetchLine(row + j);
}

// Random row accesses are bound by memory latency, so each core adds loads in
// flight. Work below this many row values stays on the calling thread.
constexpr int64_t kMinParallelValues = 1 << 14;

// Chunks of a loop, claimed one at a time by the calling thread and by helpers
// on XLA's intra-op pool. The caller never waits for a chunk nobody has
// claimed, so it cannot deadlock when every pool thread is busy (with other
// tables' kernels, say): unclaimed chunks it runs itself. Shared ownership
// keeps the state alive for a helper that starts after the loop is over.
struct ChunkedLoop {
  std::function<void(int64_t)> run_chunk;
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void Drain() {
    for (int64_t c = next.fetch_add(1); c < num_chunks; c = next.fetch_add(1)) {
      run_chunk(c);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs `run_chunk(c)` for every c in [0, num_chunks), in any order, possibly in parallel.
void ParallelFor(ffi::ThreadPool& pool, int64_t num_chunks, int64_t work_values,
                 std::function<void(int64_t)> run_chunk) {
  const int64_t helpers =
      work_values < kMinParallelValues ? 0 : std::min(pool.num_threads(), num_chunks - 1);
  if (helpers <= 0) {
    for (int64_t c = 0; c < num_chunks; ++c) run_chunk(c);
    return;
  }
  auto loop = std::make_shared<ChunkedLoop>();
  loop->run_chunk = std::move(run_chunk);
  loop->num_chunks = num_chunks;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([loop] { loop->Drain(); });
  loop->Drain();
  while (loop->finished.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
}

// Chunks per thread: enough to balance rows of uneven cost (cached or not).
constexpr int64_t kChunksPerThread = 4;

// Stable LSD radix sort of the in-range row ids, carrying each entry's position.
// Returns the number of in-range entries; `sorted_rows[i]` and `position[i]`
// hold them in ascending row order, ties in input order.
int64_t SortRows(const int32_t* rows, int64_t nse, int64_t num_rows,
                 std::vector<uint32_t>& sorted_rows, std::vector<uint32_t>& position) {
  constexpr int kDigitBits = 11;
  constexpr uint32_t kBuckets = 1u << kDigitBits;
  std::vector<uint32_t> key, pos;
  key.reserve(nse);
  pos.reserve(nse);
  for (int64_t i = 0; i < nse; ++i) {
    if (rows[i] >= 0 && rows[i] < num_rows) {
      key.push_back(static_cast<uint32_t>(rows[i]));
      pos.push_back(static_cast<uint32_t>(i));
    }
  }
  const int64_t n = static_cast<int64_t>(key.size());
  std::vector<uint32_t> key_out(n), pos_out(n);
  std::vector<uint32_t> count(kBuckets);
  for (int shift = 0; shift < 32 && (static_cast<uint64_t>(num_rows - 1) >> shift) > 0;
       shift += kDigitBits) {
    std::fill(count.begin(), count.end(), 0u);
    for (int64_t i = 0; i < n; ++i) ++count[(key[i] >> shift) & (kBuckets - 1)];
    uint32_t total = 0;
    for (uint32_t b = 0; b < kBuckets; ++b) {
      const uint32_t c = count[b];
      count[b] = total;
      total += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t slot = count[(key[i] >> shift) & (kBuckets - 1)]++;
      key_out[slot] = key[i];
      pos_out[slot] = pos[i];
    }
    key.swap(key_out);
    pos.swap(pos_out);
  }
  sorted_rows.swap(key);
  position.swap(pos);
  return n;
}

// The first sorted entry of each run of equal rows (each distinct row), then `n`.
std::vector<int64_t> RunStarts(const std::vector<uint32_t>& sorted_rows, int64_t n) {
  std::vector<int64_t> starts;
  starts.reserve(n + 1);
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || sorted_rows[i] != sorted_rows[i - 1]) starts.push_back(i);
  }
  starts.push_back(n);
  return starts;
}

// Runs `visit(i, row)` for each entry `i` whose row is in [0, num_rows) (BCOO
// padding is dropped), in parallel on XLA's pool. `rows_unique` promises that no
// in-range row repeats: chunks of entries are then independent, and
// `prefetch(row)` is called a few entries ahead. Otherwise each chunk owns a
// range of rows and takes its entries in input order, so a repeated row's
// entries are visited in input order, as XLA's scatter takes them on one thread.
template <typename Prefetch, typename Visit>
void ForEachEntryRow(ffi::ThreadPool& pool, const int32_t* r, int64_t nse, int64_t num_rows,
                     int64_t row_size, bool rows_unique, Prefetch prefetch, Visit visit) {
  const int64_t threads = pool.num_threads() + 1;
  if (rows_unique) {
    const int64_t num_chunks = std::max<int64_t>(1, std::min(nse, kChunksPerThread * threads));
    auto run_chunk = [&](int64_t chunk) {
      const int64_t begin = nse * chunk / num_chunks;
      const int64_t end = nse * (chunk + 1) / num_chunks;
      for (int64_t i = begin; i < end; ++i) {
        if (i + kPrefetchRows < end) {
          const int64_t ahead = r[i + kPrefetchRows];
          if (ahead >= 0 && ahead < num_rows) prefetch(ahead);
        }
        const int64_t row = r[i];
        if (row >= 0 && row < num_rows) visit(i, row);
      }
    };
    ParallelFor(pool, num_chunks, nse * row_size, run_chunk);
    return;
  }
  const int64_t num_chunks = std::max<int64_t>(1, std::min(num_rows, threads));
  auto run_chunk = [&](int64_t chunk) {
    const int64_t lo = num_rows * chunk / num_chunks;
    const int64_t hi = num_rows * (chunk + 1) / num_chunks;
    for (int64_t i = 0; i < nse; ++i) {
      const int64_t row = r[i];
      if (row >= lo && row < hi) visit(i, row);
    }
  };
  ParallelFor(pool, num_chunks, nse * row_size, run_chunk);
}

// Moments are stored as float32 or as bfloat16 (its bits in a uint16_t); the
// arithmetic is float32 either way.
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

inline uint32_t Bits(float x) {
  uint32_t word;
  std::memcpy(&word, &x, sizeof(word));
  return word;
}
inline float WithBits(uint32_t word) {
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

// float16 bits -> float32, exact (subnormals, inf, NaN with its payload).
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t shifted = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  const uint32_t exponent = shifted & 0x0F800000u;
  uint32_t word = shifted + ((127u - 15u) << 23);
  if (exponent == 0x0F800000u) word += (128u - 16u) << 23;  // inf, NaN
  float x = WithBits(word);
  // Zero and subnormals: renormalised by float32's own subtraction (exact).
  if (exponent == 0) x = WithBits(word + (1u << 23)) - WithBits(113u << 23);
  return WithBits(Bits(x) | sign);
}

// float32 -> float16 bits, to nearest, ties to even, as XLA and F16C convert:
// beyond float16's range inf, NaN quieted with its payload's top bits.
inline uint16_t F16Nearest(float x) {
  uint32_t f = Bits(x);
  const uint32_t sign = (f >> 16) & 0x8000u;
  f &= 0x7FFFFFFFu;
  uint32_t h;
  if (f > 0x7F800000u) {
    h = 0x7E00u | ((f & 0x7FFFFFu) >> 13);
  } else if (f >= 0x47800000u) {  // 2^16 and above: inf
    h = 0x7C00u;
  } else if (f < 0x38800000u) {  // below 2^-14: float32's addition rounds at 2^-24
    h = Bits(WithBits(f) + 0.5f) - Bits(0.5f);
  } else {  // normal: 13 bits dropped, to nearest even
    h = (f + ((15u - 127u) << 23) + 0xFFFu + ((f >> 13) & 1u)) >> 13;
  }
  return static_cast<uint16_t>(h | sign);
}

// Rows of float16 converted to and from float32: 8 values an instruction with
// F16C (x86-64, checked at run time), whose conversions are XLA:CPU's; else the
// portable ones above (the same bits).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) inline void WidenF16C(float* out, const uint16_t* in,
                                                         int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j));
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(h));
  }
  for (; j < n; ++j) out[j] = F16ToFloat(in[j]);
}
__attribute__((target("avx,f16c"))) inline void NarrowF16C(uint16_t* out, const float* in,
                                                          int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), h);
  }
  for (; j < n; ++j) out[j] = F16Nearest(in[j]);
}
inline bool HasF16C() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return has;
}
#else
inline bool HasF16C() { return false; }
inline void WidenF16C(float*, const uint16_t*, int64_t) {}
inline void NarrowF16C(uint16_t*, const float*, int64_t) {}
#endif

inline void WidenF16Row(float* out, const uint16_t* in, int64_t n) {
  if (HasF16C()) return WidenF16C(out, in, n);
  for (int64_t j = 0; j < n; ++j) out[j] = F16ToFloat(in[j]);
}
inline void NarrowF16Row(uint16_t* out, const float* in, int64_t n) {
  if (HasF16C()) return NarrowF16C(out, in, n);
  for (int64_t j = 0; j < n; ++j) out[j] = F16Nearest(in[j]);
}

// MurmurHash3's 32-bit finalizer, as `rounding.fmix32`.
inline uint32_t Fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// The key of one row of one slot for stochastic rounding (`rounding.random_bits`).
inline uint32_t RowKey(uint32_t slot_key, int64_t row) {
  return Fmix32(slot_key ^ (static_cast<uint32_t>(row) * 0x85EBCA77u));
}

// The multiplier of an element's index in its stochastic-rounding hash
// (`rounding._ELEMENT_MULTIPLIER`).
constexpr uint32_t kElementMultiplier = 0xC2B2AE3Du;

// The 32-bit stochastic-rounding hash of element j of a row
// (`rounding.element_hash`): `Fmix32(row_key ^ j_mixed)`, where `j_mixed` is
// `j * kElementMultiplier` (32-bit wrapping). Row loops count `j_mixed` in a
// uint32_t of their own, adding the multiplier each element: vectorized, that
// is one add in 32-bit lanes, where `j * multiplier` of the loop's int64_t
// index took a multiply and shuffles narrowing its lanes. A pair of slots
// (Adam's mu and nu) rounds with one hash: the first slot with its top 16
// bits, the second with its low 16 (`PairBits`).
inline uint32_t ElementHash(uint32_t row_key, uint32_t j_mixed) {
  return Fmix32(row_key ^ j_mixed);
}

// The 16 random bits of each slot of a pair, from the element's hash `h`.
inline uint32_t FirstOfPairBits(uint32_t h) { return h >> 16; }
inline uint32_t SecondOfPairBits(uint32_t h) { return h & 0xFFFFu; }

// The 16 random bits of a one-slot rule's element (`ElementHash`'s top half;
// the compiler drops Fmix32's last `x ^ (x >> 16)`, which the top half ignores).
inline uint32_t StochasticBits(uint32_t row_key, uint32_t j_mixed) {
  return FirstOfPairBits(ElementHash(row_key, j_mixed));
}

// Stores `x` in `*dst`'s format and returns the stored value. For bfloat16,
// `kStochastic` rounds with the 16 random bits `bits16` (`StochasticBits`,
// `FirstOfPairBits`, `SecondOfPairBits`), else to nearest, ties to even.
// Branch-free but for the template switch, so the row loops vectorize: an
// inf's low 16 bits are zero, so adding at most 0xFFFF keeps it inf; only NaN
// is replaced, by the quiet NaN of its sign, as XLA converts it (NaN: magnitude
// bits above inf's, compared as int32, which AVX2 compares in one instruction,
// unlike uint32).
template <bool kStochastic>
inline uint16_t Bf16Bits(float x, uint32_t bits16) {
  uint32_t word;
  std::memcpy(&word, &x, sizeof(word));
  const uint32_t add = kStochastic ? bits16 : 0x7FFFu + ((word >> 16) & 1u);
  const uint32_t rounded = (word + add) >> 16;
  const uint32_t quiet_nan = ((word >> 16) & 0x8000u) | 0x7FC0u;
  const bool nan = static_cast<int32_t>(word & 0x7FFFFFFFu) > 0x7F800000;
  return static_cast<uint16_t>(nan ? quiet_nan : rounded);
}
template <bool kStochastic>
inline float StoreMomentBits(float* dst, float x, uint32_t) {
  *dst = x;
  return x;
}
template <bool kStochastic>
inline float StoreMomentBits(uint16_t* dst, float x, uint32_t bits16) {
  const uint16_t bits = Bf16Bits<kStochastic>(x, bits16);
  *dst = bits;
  return ToFloat(bits);
}
// `StoreMomentBits` with a one-slot rule's bits of the element (`StochasticBits`).
template <bool kStochastic, typename T>
inline float StoreMoment(T* dst, float x, uint32_t row_key, uint32_t j_mixed) {
  return StoreMomentBits<kStochastic>(dst, x, kStochastic ? StochasticBits(row_key, j_mixed) : 0u);
}

// Weight decay, as `StepConfig.weight_decay`: none, L2 (`g += wd * p`, before
// the rule) or decoupled (`delta -= lr * wd * p`, after it).
enum Decay : int { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

OSA_MULTIVERSIONED inline void AddRow(
    float* __restrict__ dst, const float* __restrict__ src, int64_t row_size) {
  for (int64_t j = 0; j < row_size; ++j) dst[j] += src[j];
}

// The row size of a table of `count` values viewed as `num_rows` rows (its
// leading dims), or -1.
int64_t RowSize(size_t count, int64_t num_rows) {
  const int64_t n = static_cast<int64_t>(count);
  if (num_rows <= 0 || n % num_rows != 0) return -1;
  return n / num_rows;
}

// Copies a table into XLA's output buffer where they differ (no donation).
inline void CopyIfNotAliased(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

// A float16 gradient value: its bits, in a type of its own (bfloat16's are a uint16_t).
struct Float16 {
  uint16_t bits;
};
inline float ToFloat(Float16 h) { return F16ToFloat(h.bits); }

// A gradient's value as float32: float32, bfloat16 (its bits) or float16 (`Float16`).
// `SumRounded<T>` rounds a sum to T, as XLA rounds each add of 16-bit floats.
template <typename T>
inline float SumRounded(float x) {
  if constexpr (std::is_same_v<T, uint16_t>) return ToFloat(Bf16Bits<false>(x, 0));
  if constexpr (std::is_same_v<T, Float16>) return F16ToFloat(F16Nearest(x));
  return x;
}

// Where a row's sum starts: -0.0, the identity of float addition (-0.0 + x is x for
// every x, either zero included; a NaN comes out quiet), so a sum is its first entry
// plus the others in order, as torch's coalesce copies a row's first entry and adds
// the rest: a lone -0.0, or -0.0s alone, stay -0.0 (from +0.0 they became +0.0).
constexpr float kSumStart = -0.0f;

// `g[0:kWidth]` = the sum of `values[position[e] * row_size:][0:kWidth]` for e in
// [begin, end), added in that order from `kSumStart`, each add rounded to T
// (`SumRounded`); the sums stay in registers over the entries.
template <int64_t kWidth, typename T>
inline void SumEntriesBlock(float* __restrict__ g, const T* __restrict__ values,
                            const uint32_t* __restrict__ position, int64_t begin, int64_t end,
                            int64_t row_size) {
  float acc[kWidth];
  for (int64_t k = 0; k < kWidth; ++k) acc[k] = kSumStart;
  for (int64_t e = begin; e < end; ++e) {
    const T* v = values + static_cast<int64_t>(position[e]) * row_size;
    for (int64_t k = 0; k < kWidth; ++k) acc[k] = SumRounded<T>(acc[k] + ToFloat(v[k]));
  }
  for (int64_t k = 0; k < kWidth; ++k) g[k] = acc[k];
}

// `g` = the sum of the rows `values[position[e]]` for e in [begin, end), each
// add rounded to T, in blocks of 16 values (then 1) kept in registers (blocks
// of 32 or 64 measured slower: spilled).
template <typename T>
OSA_MULTIVERSIONED_TEMPLATE void SumEntries(float* __restrict__ g, const T* __restrict__ values,
                                            const uint32_t* __restrict__ position, int64_t begin,
                                            int64_t end, int64_t row_size) {
  int64_t j = 0;
  for (; j + 16 <= row_size; j += 16) {
    SumEntriesBlock<16>(g + j, values + j, position, begin, end, row_size);
  }
  for (; j < row_size; ++j) SumEntriesBlock<1>(g + j, values + j, position, begin, end, row_size);
}

#if defined(__x86_64__) && defined(__GNUC__)
// `SumEntries` of float16 values with F16C's conversions, 16 values (then 8) a block
// in two (one) AVX registers: each add in float32, rounded to float16 to nearest
// (`_mm256_cvtps_ph`, XLA:CPU's conversion) and widened back, as XLA adds float16.
__attribute__((target("avx,f16c"))) inline __m256 RoundedToF16(__m256 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("avx,f16c"))) inline __m256 LoadF16(const uint16_t* v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
}
__attribute__((target("avx,f16c"))) inline void SumEntriesF16C(
    float* __restrict__ g, const uint16_t* __restrict__ values,
    const uint32_t* __restrict__ position, int64_t begin, int64_t end, int64_t row_size,
    int64_t j) {
  for (; j + 16 <= row_size; j += 16) {
    __m256 a0 = _mm256_set1_ps(kSumStart);
    __m256 a1 = _mm256_set1_ps(kSumStart);
    for (int64_t e = begin; e < end; ++e) {
      const uint16_t* v = values + static_cast<int64_t>(position[e]) * row_size + j;
      a0 = RoundedToF16(_mm256_add_ps(a0, LoadF16(v)));
      a1 = RoundedToF16(_mm256_add_ps(a1, LoadF16(v + 8)));
    }
    _mm256_storeu_ps(g + j, a0);
    _mm256_storeu_ps(g + j + 8, a1);
  }
  for (; j + 8 <= row_size; j += 8) {
    __m256 a = _mm256_set1_ps(kSumStart);
    for (int64_t e = begin; e < end; ++e) {
      const uint16_t* v = values + static_cast<int64_t>(position[e]) * row_size + j;
      a = RoundedToF16(_mm256_add_ps(a, LoadF16(v)));
    }
    _mm256_storeu_ps(g + j, a);
  }
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// `SumEntries` of bfloat16 values (their bits) with AVX2, 32 values (then 8) a block in
// four (one) registers, so that four chains of dependent adds are in flight: each add in
// float32, rounded to bfloat16 by `Bf16Bits<false>`'s integer ops lane by lane (to
// nearest, ties to even; NaN to the quiet NaN of its sign) and kept widened (its low 16
// bits zero). The first entry's sum `kSumStart + v` is v (v is bfloat16): only its NaNs are
// replaced. GCC left the portable loop's rounding scalar.
__attribute__((target("avx2"))) inline __m256 LoadBf16(const uint16_t* v) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// `x` where it is not NaN, else the quiet NaN of its sign.
__attribute__((target("avx2"))) inline __m256 QuietNaNs(__m256 x, __m256 rounded) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256i sign = _mm256_and_si256(_mm256_castps_si256(x),
                                        _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i quiet = _mm256_or_si256(sign, _mm256_set1_epi32(0x7FC00000));
  return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(quiet), nan);
}
__attribute__((target("avx2"))) inline __m256 RoundedToBf16(__m256 x) {
  const __m256i word = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(word, 16), _mm256_set1_epi32(1));
  const __m256i add = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(word, add),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return QuietNaNs(x, _mm256_castsi256_ps(rounded));
}
constexpr int64_t kPrefetchEntries = 16;
template <int kVectors>
__attribute__((target("avx2"))) inline void SumBf16Block(float* __restrict__ g,
                                                         const uint16_t* __restrict__ values,
                                                         const uint32_t* __restrict__ position,
                                                         int64_t begin, int64_t end,
                                                         int64_t row_size) {
  __m256 a[kVectors];
  for (int k = 0; k < kVectors; ++k) a[k] = _mm256_set1_ps(kSumStart);
  if (begin < end) {
    const uint16_t* v = values + static_cast<int64_t>(position[begin]) * row_size;
    for (int k = 0; k < kVectors; ++k) {
      const __m256 sum = _mm256_add_ps(a[k], LoadBf16(v + 8 * k));  // exactly v, NaN quieted
      a[k] = QuietNaNs(sum, sum);
    }
  }
  for (int64_t e = begin + 1; e < end; ++e) {
    // A popular row's entries, read at random places of the gradient: each block's line
    // (64 bytes) prefetched a few entries ahead, as the rounding's long chain of integer
    // ops leaves the core too few loads in flight to hide their latency.
    if (e + kPrefetchEntries < end) {
      PrefetchLine(values + static_cast<int64_t>(position[e + kPrefetchEntries]) * row_size);
    }
    const uint16_t* v = values + static_cast<int64_t>(position[e]) * row_size;
    for (int k = 0; k < kVectors; ++k) {
      a[k] = RoundedToBf16(_mm256_add_ps(a[k], LoadBf16(v + 8 * k)));
    }
  }
  for (int k = 0; k < kVectors; ++k) _mm256_storeu_ps(g + 8 * k, a[k]);
}
__attribute__((target("avx2"))) inline void SumEntriesBf16Avx2(
    float* __restrict__ g, const uint16_t* __restrict__ values,
    const uint32_t* __restrict__ position, int64_t begin, int64_t end, int64_t row_size,
    int64_t j) {
  for (; j + 32 <= row_size; j += 32) {
    SumBf16Block<4>(g + j, values + j, position, begin, end, row_size);
  }
  for (; j + 8 <= row_size; j += 8) {
    SumBf16Block<1>(g + j, values + j, position, begin, end, row_size);
  }
}
inline bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// `SumEntries` of bfloat16 values (their bits): AVX2 where the CPU has it (the same
// bits), the portable blocks for the rest of the row.
inline void SumEntries(float* __restrict__ g, const uint16_t* __restrict__ values,
                       const uint32_t* __restrict__ position, int64_t begin, int64_t end,
                       int64_t row_size) {
  int64_t j = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (HasAvx2()) {
    SumEntriesBf16Avx2(g, values, position, begin, end, row_size, 0);
    j = row_size - row_size % 8;
  }
#endif
  for (; j < row_size; ++j) SumEntriesBlock<1>(g + j, values + j, position, begin, end, row_size);
}

// `SumEntries` of float16 values: F16C's conversions where the CPU has them (XLA:CPU
// converts with them; the portable ones are the same bits, several times slower), the
// portable ones for the rest of the row.
inline void SumEntries(float* __restrict__ g, const Float16* __restrict__ values,
                       const uint32_t* __restrict__ position, int64_t begin, int64_t end,
                       int64_t row_size) {
  int64_t j = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (HasF16C()) {
    SumEntriesF16C(g, reinterpret_cast<const uint16_t*>(values), position, begin, end, row_size,
                   0);
    j = row_size - row_size % 8;
  }
#endif
  for (; j < row_size; ++j) SumEntriesBlock<1>(g + j, values + j, position, begin, end, row_size);
}

// Prefetches the gradient rows `values[position[e]]` for e in [begin, end): a
// distinct row's entries, read at random places of the gradient.
template <typename T>
inline void PrefetchEntries(const T* values, const uint32_t* position, int64_t begin, int64_t end,
                            int64_t row_size) {
  for (int64_t e = begin; e < end; ++e) {
    PrefetchRow(values + static_cast<int64_t>(position[e]) * row_size, row_size);
  }
}

// Coalesces a gradient's rows: sorts them (`SortRows`) and runs
// `visit(s, row, begin, end)` on each distinct row, the s-th in ascending
// order, whose entries are `position[begin:end]` (`position` in input order),
// in parallel chunks of distinct rows on XLA's pool, a row prefetched a few rows
// ahead (`prefetch(row, position, begin, end)`: its entries too). Writes
// `out_rows`: the distinct rows, then num_rows + slot for padding slots. Returns
// the number of distinct rows.
template <typename Prefetch, typename Visit>
int64_t ForEachCoalescedRow(const int32_t* rows, int64_t nse, int64_t num_rows, int64_t row_size,
                            ffi::ThreadPool& pool, int32_t* out_rows, Prefetch prefetch,
                            Visit visit) {
  std::vector<uint32_t> sorted_rows, position;
  const int64_t n = SortRows(rows, nse, num_rows, sorted_rows, position);
  const std::vector<int64_t> starts = RunStarts(sorted_rows, n);
  const int64_t num_unique = static_cast<int64_t>(starts.size()) - 1;
  const int64_t num_chunks = std::max<int64_t>(
      1, std::min<int64_t>(num_unique, kChunksPerThread * (pool.num_threads() + 1)));
  auto run_chunk = [&](int64_t chunk) {
    const int64_t begin = num_unique * chunk / num_chunks;
    const int64_t end = num_unique * (chunk + 1) / num_chunks;
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchRows < end) {
        const int64_t ahead = s + kPrefetchRows;
        prefetch(sorted_rows[starts[ahead]], position.data(), starts[ahead], starts[ahead + 1]);
      }
      const int64_t row = sorted_rows[starts[s]];
      out_rows[s] = static_cast<int32_t>(row);
      visit(s, row, position.data(), starts[s], starts[s + 1]);
    }
  };
  ParallelFor(pool, num_chunks, num_unique * row_size, run_chunk);
  for (int64_t s = num_unique; s < nse; ++s) out_rows[s] = static_cast<int32_t>(num_rows + s);
  return num_unique;
}

// Coalesces a gradient's rows and runs `update(row, entry, g)` on each distinct
// row (`entry`: the position of the row's first gradient entry).
//
// `g` is the row's summed gradient (`SumEntries`), written into the delta
// output (the update turns it into the row's delta). Distinct rows are
// disjoint, so chunks of them run in parallel. `prefetch(row)` is called a few
// rows ahead of each update. Outputs: as `ForEachCoalescedRow`; the deltas of
// those rows (zero in padding).
template <typename T, typename Prefetch, typename Update>
void CoalescedRowsStep(const int32_t* rows, int64_t nse, const T* values, int64_t num_rows,
                       int64_t row_size, ffi::ThreadPool& pool, int32_t* out_rows, float* out,
                       Prefetch prefetch, Update update) {
  const int64_t num_unique = ForEachCoalescedRow(
      rows, nse, num_rows, row_size, pool, out_rows,
      [&](int64_t row, const uint32_t* position, int64_t begin, int64_t end) {
        prefetch(row);
        PrefetchEntries(values, position, begin, end, row_size);
      },
      [&](int64_t s, int64_t row, const uint32_t* position, int64_t begin, int64_t end) {
        float* g = out + s * row_size;
        SumEntries(g, values, position, begin, end, row_size);
        update(row, static_cast<int64_t>(position[begin]), g);
      });
  std::memset(out + num_unique * row_size, 0, sizeof(float) * (nse - num_unique) * row_size);
}

// The sum of a row's `row_size` values in `scratch`, added pairwise in
// `rowwise_adam.pairwise_row_sum`'s order: halves added until one value is
// left, an odd last value carried along. Overwrites `scratch`.
inline float PairwiseSum(float* scratch, int64_t row_size) {
  if (row_size == 0) return 0.0f;
  int64_t width = row_size;
  while (width > 1) {
    const int64_t half = width / 2;
    for (int64_t i = 0; i < half; ++i) scratch[i] = scratch[i] + scratch[half + i];
    if (width % 2) scratch[half] = scratch[2 * half];
    width = half + width % 2;
  }
  return scratch[0];
}

// The FFI binding every row step shares (`CoalescedRowsStep`'s): its first
// inputs, the gradient's rows (int32) and values (float32, bfloat16 or float16; the
// scatter-add takes its update's so too, float32 only); then, after the step's own inputs, the
// attributes `RowStepAttrs`; then, after the step's own attributes, the pool
// and the first outputs `RowStepOutputs`.
inline auto RowStepBinding() {
  return ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::AnyBuffer>();
}

// Returns `run(values)` with the gradient's values typed: float32, bfloat16 (its
// bits) or float16 (`Float16`; `SumEntries` rounds 16-bit sums at every add, as XLA).
template <typename Run>
ffi::Error WithValues(const ffi::AnyBuffer& values, Run run) {
  if (values.element_type() == ffi::DataType::F32) {
    return run(static_cast<const float*>(values.untyped_data()));
  }
  if (values.element_type() == ffi::DataType::BF16) {
    return run(static_cast<const uint16_t*>(values.untyped_data()));
  }
  if (values.element_type() == ffi::DataType::F16) {
    return run(static_cast<const Float16*>(values.untyped_data()));
  }
  return ffi::Error::InvalidArgument("values must be float32, bfloat16 or float16");
}

// The FFI binding of a kernel that writes rows into a table in place (`row_store.cc`,
// `row_round.cc`'s apply): the rows (int32), their values and the table (any dtype), then
// the attributes `num_rows` and `rows_unique`.
inline auto RowsIntoTableBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Attr<int64_t>("num_rows")
      .Attr<bool>("rows_unique");
}

// The table's number of rows, whether the step maximizes, whether bfloat16
// slots round stochastically.
template <typename Binding>
auto RowStepAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("num_rows")
      .template Attr<bool>("maximize")
      .template Attr<bool>("stochastic");
}

// `binding` with one attribute of type T per name, in order (a step's flags).
// One name at least: a binding cannot be returned as is (its move is private).
template <typename T, typename Binding>
auto Attrs(Binding&& binding, const char* name) {
  return std::move(binding).template Attr<T>(name);
}
template <typename T, typename Binding, typename... Names>
auto Attrs(Binding&& binding, const char* name, const char* next, Names... rest) {
  return Attrs<T>(std::move(binding).template Attr<T>(name), next, rest...);
}

// XLA's thread pool, then the distinct rows (and padding) and their deltas.
template <typename Binding>
auto RowStepOutputs(Binding&& binding) {
  return std::move(binding)
      .template Ctx<ffi::ThreadPool>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

#endif  // OPTAX_SPARSE_ADAM_BACKENDS_CPU_FFI_COMMON_H_
