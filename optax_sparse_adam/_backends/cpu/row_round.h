// A 16-bit table's new row `round(old + delta)` (bfloat16 or float16, to nearest
// or stochastically, `rounding.stochastic_round` with the parameter's bits), shared
// by the generic kernels of 16-bit tables (`row_round.cc`) and the Adam kernel that
// rounds its rows in its own pass (`kernels.cc`): one definition of the bits.
// Included after ffi_common.h, inside its files' anonymous namespace.

#ifndef OPTAX_SPARSE_ADAM_BACKENDS_CPU_ROW_ROUND_H_
#define OPTAX_SPARSE_ADAM_BACKENDS_CPU_ROW_ROUND_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

// A float32 scratch row per thread (`k` of them: 0 or 1).
inline float* Scratch(int k, int64_t n) {
  thread_local std::vector<float> rows[2];
  if (static_cast<int64_t>(rows[k].size()) < n) rows[k].resize(n);
  return rows[k].data();
}

// `x`, finite, rounded stochastically to a float16 value held in float32
// (`rounding.stochastic_round`'s float16 branch, branch-free): the value is
// exact in float16, so converting it to nearest stores it.
inline float F16StochasticValue(float x, uint32_t u) {
  // Selects on integer compares of the bits (positive floats order as their bits):
  // branch-free, so the row loop vectorizes.
  const uint32_t magnitude_bits = Bits(x) & 0x7FFFFFFFu;
  const uint32_t normal = (magnitude_bits + (u >> 3)) & 0xFFFFE000u;
  // Used below 2^-14 only: there `scaled` < 2^10 and truncation is floor (clamped
  // above, so that the conversion stays in range where it is not used).
  const uint32_t clamped = magnitude_bits < 0x38800000u ? magnitude_bits : 0x38800000u;
  const float scaled = WithBits(clamped) * 16777216.0f;  // 2^24
  const float whole = static_cast<float>(static_cast<int32_t>(scaled));
  // In [0, 2^16): int32 conversions and compares, which AVX2 vectorizes (uint32 ones not).
  const int32_t fraction = static_cast<int32_t>((scaled - whole) * 65536.0f);
  const int32_t carry = fraction + static_cast<int32_t>(u) >= 65536 ? 1 : 0;
  const uint32_t subnormal = Bits((whole + static_cast<float>(carry)) * 5.9604644775390625e-8f);
  // A mask, not `?:`: GCC sank the subnormal branch's float-to-int conversions into a
  // branch, which trapping math then kept from vectorizing (about 6 ns a value).
  const uint32_t below = 0u - static_cast<uint32_t>(magnitude_bits < 0x38800000u);
  const int32_t rounded = static_cast<int32_t>((subnormal & below) | (normal & ~below));
  const int32_t largest = static_cast<int32_t>(Bits(65504.0f));
  const uint32_t saturated = static_cast<uint32_t>(rounded > largest ? largest : rounded);
  return WithBits(saturated | (Bits(x) & 0x80000000u));
}

// `a[j]` rounded stochastically to float16 values (still float32) with the
// parameter's bits of the row (`row_key`); non-finite values left as they are.
OSA_MULTIVERSIONED inline void F16StochasticRow(float* __restrict__ a, int64_t n, uint32_t row_key) {
  uint32_t j_mixed = 0;
  for (int64_t j = 0; j < n; ++j, j_mixed += kElementMultiplier) {
    const float x = a[j];
    const float r = F16StochasticValue(x, StochasticBits(row_key, j_mixed));
    a[j] = (Bits(x) & 0x7F800000u) != 0x7F800000u ? r : x;  // finite
  }
}

OSA_MULTIVERSIONED inline void AddRow16(float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  for (int64_t j = 0; j < n; ++j) a[j] = a[j] + b[j];
}

// A 16-bit dtype's conversions: kF16 float16, else bfloat16.
template <bool kF16>
inline float Widen(uint16_t bits) {
  if constexpr (kF16) return F16ToFloat(bits);
  return ToFloat(bits);
}
template <bool kF16>
inline uint16_t Nearest(float x) {
  if constexpr (kF16) return F16Nearest(x);
  return Bf16Bits<false>(x, 0);
}

// `rounding.stochastic_round(x, u, dtype)`: up with probability the dropped
// fraction of an ulp (read against the 16 random bits `u`), a finite value
// beyond the dtype's largest saturated to it, NaN and inf to nearest.
template <bool kF16>
inline uint16_t Stochastic(float x, uint32_t u) {
  if constexpr (!kF16) {
    // Branch-free (selects on the bits), so that the row loop vectorizes: a finite value
    // carried up into inf is saturated; inf and NaN take `Bf16Bits<false>`'s nearest.
    const uint32_t word = Bits(x);
    const uint32_t up = (word + u) >> 16;  // finite: no carry out of 32 bits
    const uint32_t saturated = ((word >> 16) & 0x8000u) | 0x7F7Fu;
    const uint32_t stochastic = (up & 0x7FFFu) == 0x7F80u ? saturated : up;
    const uint32_t finite = 0u - static_cast<uint32_t>((word & 0x7F800000u) != 0x7F800000u);
    const uint32_t nearest = Bf16Bits<false>(x, 0u);
    return static_cast<uint16_t>((stochastic & finite) | (nearest & ~finite));
  }
  if (!std::isfinite(x)) return Nearest<kF16>(x);
  return static_cast<uint16_t>(F16Nearest(F16StochasticValue(x, u)));
}

// `out = round(old + delta)` for one row; `row_key` keys the stochastic bits.
template <bool kF16, bool kStochastic>
OSA_MULTIVERSIONED_TEMPLATE void AddRoundRowBf16(uint16_t* __restrict__ out,
                                                 const uint16_t* __restrict__ old,
                                                 const float* __restrict__ delta,
                                                 int64_t row_size, uint32_t row_key) {
  uint32_t j_mixed = 0;
  for (int64_t j = 0; j < row_size; ++j, j_mixed += kElementMultiplier) {
    const float x = Widen<kF16>(old[j]) + delta[j];
    out[j] = kStochastic ? Stochastic<kF16>(x, StochasticBits(row_key, j_mixed)) : Nearest<kF16>(x);
  }
}
template <bool kF16, bool kStochastic>
void AddRoundRow(uint16_t* out, const uint16_t* old, const float* delta, int64_t row_size,
                 uint32_t row_key) {
  if constexpr (!kF16) {
    AddRoundRowBf16<false, kStochastic>(out, old, delta, row_size, row_key);
  } else {  // float16: converted a row at a time
    float* a = Scratch(0, row_size);
    WidenF16Row(a, old, row_size);
    AddRow16(a, delta, row_size);
    if (kStochastic) F16StochasticRow(a, row_size, row_key);
    NarrowF16Row(out, a, row_size);
  }
}

// The epilogue of a fused step that rounds a 16-bit table's rows stochastically in its
// own pass (`param_rounding="stochastic"`): each distinct row's new value
// `round(table[row] + delta)` (`AddRoundRow`, the bits of `add_rounded_rows` and
// `xla.rounded_param_rows`) written while the row's delta is at hand, the table's row
// prefetched with the step's own. One definition for every kernel that takes it (the
// Adam kernels, the rule kernels): a kernel calls `Row` after each row's delta,
// whatever its rule or options. Inputs: table (bf16 or f16; empty: the step rounds no
// rows) and param_keys u32 (2,) (the parameter's key of this step, `rounding.kernel_keys`
// at `PARAM_SLOT`, and the table's first global row); output new_rows (nse, row_size) in
// the table's dtype, zeros at padding (empty when the table is).
class RoundedRows {
 public:
  // Checks the buffers; `delta` is the step's delta output (a row's place in new_rows).
  ffi::Error Prepare(const ffi::AnyBuffer& table, const ffi::Buffer<ffi::U32>& param_keys,
                     ffi::Result<ffi::AnyBuffer>& new_rows, const float* delta, int64_t nse,
                     int64_t num_rows, int64_t row_size) {
    if (table.element_count() == 0) {
      if (new_rows->element_count() != 0) {
        return ffi::Error::InvalidArgument("new_rows must be empty when the table is");
      }
      return ffi::Error::Success();
    }
    const ffi::DataType type = table.element_type();
    if (type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
      return ffi::Error::InvalidArgument("the rounded table must be bfloat16 or float16");
    }
    if (new_rows->element_type() != type || row_size <= 0 ||
        static_cast<int64_t>(table.element_count()) != num_rows * row_size ||
        static_cast<int64_t>(new_rows->element_count()) != nse * row_size ||
        param_keys.element_count() != 2) {
      return ffi::Error::InvalidArgument(
          "the rounded table must hold num_rows rows of the step's size, new_rows nse rows "
          "in its dtype, param_keys (2,)");
    }
    table_ = static_cast<const uint16_t*>(table.untyped_data());
    out_ = static_cast<uint16_t*>(new_rows->untyped_data());
    delta_ = delta;
    row_size_ = row_size;
    key_ = param_keys.typed_data()[0];
    row_offset_ = param_keys.typed_data()[1];
    f16_ = type == ffi::DataType::F16;
    return ffi::Error::Success();
  }

  bool active() const { return table_ != nullptr; }

  void Prefetch(int64_t row) const {
    if (table_ != nullptr) PrefetchRow(table_ + row * row_size_, row_size_);
  }

  // The new value of `row`, whose delta is `g` (a row of the step's delta output).
  void Row(int64_t row, const float* g) const {
    if (table_ == nullptr) return;
    uint16_t* out = out_ + (g - delta_);  // the row's place in the output
    const uint16_t* old = table_ + row * row_size_;
    const uint32_t key = RowKey(key_, static_cast<uint32_t>(row) + row_offset_);
    if (f16_) {
      AddRoundRow<true, true>(out, old, g, row_size_, key);
    } else {
      AddRoundRow<false, true>(out, old, g, row_size_, key);
    }
  }

  // Zeros the padding's rows (out of range in `distinct_rows`), after the step.
  void ZeroPadding(const int32_t* distinct_rows, int64_t nse, int64_t num_rows) const {
    if (table_ == nullptr) return;
    for (int64_t s = 0; s < nse; ++s) {
      if (distinct_rows[s] < 0 || distinct_rows[s] >= num_rows) {
        std::memset(out_ + s * row_size_, 0, sizeof(uint16_t) * row_size_);
      }
    }
  }

 private:
  const uint16_t* table_ = nullptr;
  uint16_t* out_ = nullptr;
  const float* delta_ = nullptr;
  int64_t row_size_ = 0;
  uint32_t key_ = 0;
  uint32_t row_offset_ = 0;
  bool f16_ = false;
};

}  // namespace

#endif  // OPTAX_SPARSE_ADAM_BACKENDS_CPU_ROW_ROUND_H_
