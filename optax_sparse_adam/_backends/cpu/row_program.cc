// The row program kernel: any elementwise rule's step in one pass, with no
// per-rule C++ (`row_program.py` compiles the rule's traced `update` into the
// op list this interprets).
//
// The gradient's rows are coalesced as every kernel coalesces them
// (`ffi_common.h`: each row's entries summed in input order from -0.0), and on
// each distinct row the program runs over registers of kChunk columns, chunk by
// chunk: register 0 is the row's summed gradient (in the output), 1 the
// parameter's row, 2.. each slot's row, all read where they lie (donated tables
// are not copied); then the program's values, in thread-local lanes that stay
// in L1. Ops on values that are the same for every row (the hyper-parameters,
// constants and what is computed from them alone) run once a call, before the
// rows (the prologue). The new slot rows and the rule's rows (deltas, or new
// values for a rule that sets rows) are computed straight into the slot tables
// and the output where no later op reads what they replace, else copied there at
// the end of the chunk; padding rows are zero. A program with per-row values (a
// per-row slot's, whose table holds one value a row, or a row's sum: `osa.row_sum`)
// runs each row as one chunk, whatever its width: a row's sum (kRowSum, `PairwiseSum`'s
// order) needs the whole row, and a per-row value is computed and stored once a row.
// Ops on per-row values run on one lane (flagged kOneLane), in runs of their own; a
// per-row value enters a row's ops by a broadcast (kBroadcast).
//
// Each op is one IEEE float32 operation, as XLA computes it: the kernels are
// compiled without contraction (every product rounded), and the Python side
// refuses a rule where XLA could contract, so the program's rows equal the
// XLA ops' bit for bit (tests/backends/test_row_program.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

// `row_program_format.py`'s op codes. Each op is 5 int32s: code, dst, a, b, c.
enum OpCode : int32_t {
  kConst = 0,    // dst = the float32 (or 32-bit) value with bits a
  kScalar = 1,   // dst = scalars[a]
  kCopy = 2,     // dst = a
  kAdd = 3,
  kSub = 4,
  kMul = 5,
  kDiv = 6,
  kMax = 7,      // XLA's (`MaxMin`): -0 < +0, a NaN a propagated as is, a NaN b signed
  kMin = 8,      // as the comparison's result
  kNeg = 9,      // the sign bit flipped (NaNs too, as XLA)
  kAbs = 10,     // the sign bit cleared
  kSqrt = 11,
  kSign = 12,    // XLA's: NaN stays, +-0 stays, else +-1
  kXor = 13,     // on the bits
  kAnd = 14,
  kOr = 15,
  kLt = 16,      // comparisons give 1 or 0 (a bool lane); NaN: false but for ne
  kLe = 17,
  kGt = 18,
  kGe = 19,
  kEq = 20,
  kNe = 21,
  kSelect = 22,  // dst = a ? c : b (`lax.select_n(a, b, c)`)
  kNot = 23,     // a bool lane negated
  kBoolToF32 = 24,
  kFma = 25,     // fma(a, b, c): XLA:CPU's contraction of a product into its one sum
  kFms = 26,     // fma(a, b, -c)
  kFnma = 27,    // fma(-a, b, c)
  kRowSum = 28,  // lane 0 of dst = the pairwise sum of a's lanes (`PairwiseSum`, the whole row)
  kBroadcast = 29,  // every lane of dst = lane 0 of a (a per-row value over the row)
  kNumOps = 30,
};
// Flags an op on per-row values (`row_program_format.ONE_LANE`): it runs on lane 0 only.
constexpr int32_t kOneLane = 256;
constexpr int64_t kOpWidth = 5;
constexpr int64_t kHeader = 5;  // num_regs, num_prologue_ops, num_row_ops, out_reg, num_slots
constexpr int64_t kInputRegs = 2;  // the gradient's and the parameter's rows; then the slots

struct Op {
  int32_t code, dst, a, b, c;
};

// The registers an op reads: a; a and b; or a, b and c (an op names 0 for those it does not
// read, and kConst's and kScalar's `a` is a value).
int Arity(int32_t code) {
  switch (code) {
    case kConst:
    case kScalar: return 0;
    case kCopy:
    case kNeg:
    case kAbs:
    case kSqrt:
    case kSign:
    case kNot:
    case kBoolToF32:
    case kRowSum:
    case kBroadcast: return 1;
    case kSelect:
    case kFma:
    case kFms:
    case kFnma: return 3;
    default: return 2;
  }
}

// Register lanes are 32 bits read as float32 by the arithmetic and as bits by the
// others: types that may alias each other.
typedef float __attribute__((may_alias)) LaneF;
typedef uint32_t __attribute__((may_alias)) LaneU;

// `d[j] = f(a[j])` and `d[j] = f(a[j], b[j])`, inlined into each clone of `RunOps`
// (so their loops take the clone's vector width).
template <typename D, typename S, typename F>
inline __attribute__((always_inline)) void Map(D* __restrict__ d, const S* __restrict__ a,
                                               int64_t n, F f) {
  for (int64_t j = 0; j < n; ++j) d[j] = f(a[j]);
}
template <typename D, typename S, typename F>
inline __attribute__((always_inline)) void Map(D* __restrict__ d, const S* __restrict__ a,
                                               const S* __restrict__ b, int64_t n, F f) {
  for (int64_t j = 0; j < n; ++j) d[j] = f(a[j], b[j]);
}

// `jnp.maximum` / `jnp.minimum` as XLA:CPU computes them (LLVM's `maximum`/`minimum`, which
// order -0 below +0 and propagate NaNs; lowered on this machine's x86 as a range op, checked
// bit for bit in tests/backends/test_row_sum_program.py): a NaN `a` as it is; else the
// greater (lesser) of the two, `b` where they are equal or `b` is NaN, with the sign bit
// that the comparison gives, `sign(a) & sign(b)` for the maximum, `sign(a) | sign(b)` for
// the minimum. Selected by masks on the bits, so that the loop vectorizes.
template <bool kMaximum>
inline __attribute__((always_inline)) void MaxMin(LaneU* __restrict__ out,
                                                  const LaneF* __restrict__ x,
                                                  const LaneF* __restrict__ y,
                                                  const LaneU* __restrict__ x_bits,
                                                  const LaneU* __restrict__ y_bits, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t xb = x_bits[j], yb = y_bits[j];
    const uint32_t take_x = 0u - static_cast<uint32_t>(kMaximum ? x[j] > y[j] : x[j] < y[j]);
    const uint32_t sign = (kMaximum ? (xb & yb) : (xb | yb)) & 0x80000000u;
    const uint32_t chosen = (((take_x & xb) | (~take_x & yb)) & 0x7FFFFFFFu) | sign;
    const uint32_t x_nan = 0u - static_cast<uint32_t>((xb & 0x7FFFFFFFu) > 0x7F800000u);
    out[j] = (x_nan & xb) | (~x_nan & chosen);
  }
}

// Lanes a register holds: a chunk of a row (the whole row where it is no wider), small
// enough that every register of a program stays in L1 while the ops run over it.
constexpr int64_t kChunk = 64;

// Runs `num_ops` ops over `N` lanes (`N == 0`: over `num_lanes`); `reg[k]` holds register
// k's lanes. A fixed `N` lets each op's loop be unrolled with no remainder.
// `scratch` holds `num_lanes` floats for a row's sum.
template <int64_t N>
OSA_MULTIVERSIONED_TEMPLATE void RunOps(const Op* ops, int64_t num_ops, uint32_t* const* reg,
                                        int64_t num_lanes, const uint32_t* scalars,
                                        float* scratch) {
  const int64_t n = N > 0 ? N : num_lanes;
  for (int64_t i = 0; i < num_ops; ++i) {
    const Op op = ops[i];  // (one-lane ops come in runs of their own: `N == 1`)
    LaneU* du = reg[op.dst];
    LaneF* df = reinterpret_cast<LaneF*>(du);
    // kConst's and kScalar's `a` is a value, not a register.
    const bool reads = op.code != kConst && op.code != kScalar;
    const LaneU* au = reads ? reg[op.a] : nullptr;
    const LaneU* bu = reg[op.b];
    const LaneU* cu = reg[op.c];
    const LaneF* af = reinterpret_cast<const LaneF*>(au);
    const LaneF* bf = reinterpret_cast<const LaneF*>(bu);
    const LaneF* cf = reinterpret_cast<const LaneF*>(cu);
    switch (op.code) {
      case kConst:
      case kScalar: {
        const uint32_t v = op.code == kConst ? static_cast<uint32_t>(op.a) : scalars[op.a];
        for (int64_t j = 0; j < n; ++j) du[j] = v;
        break;
      }
      case kCopy: std::memcpy(du, au, sizeof(uint32_t) * n); break;
      case kAdd: Map(df, af, bf, n, [](float x, float y) { return x + y; }); break;
      case kSub: Map(df, af, bf, n, [](float x, float y) { return x - y; }); break;
      case kMul:
        // Where both are NaN the first one's (quieted), as x86 and XLA's product give: the
        // compiler may swap a product's operands, which would give the second's.
        // (Selected by a mask on the bits, so that the loop vectorizes.)
        {
          LaneU* __restrict__ out = du;
          const LaneF* __restrict__ x = af;
          const LaneF* __restrict__ y = bf;
          const LaneU* __restrict__ x_bits = au;
          for (int64_t j = 0; j < n; ++j) {
            const uint32_t product = Bits(x[j] * y[j]), xb = x_bits[j];
            const uint32_t nan = 0u - static_cast<uint32_t>((xb & 0x7FFFFFFFu) > 0x7F800000u);
            out[j] = (nan & (xb | 0x00400000u)) | (~nan & product);
          }
        }
        break;
      case kDiv: Map(df, af, bf, n, [](float x, float y) { return x / y; }); break;
      case kMax: MaxMin<true>(du, af, bf, au, bu, n); break;
      case kMin: MaxMin<false>(du, af, bf, au, bu, n); break;
      case kNeg: Map(du, au, n, [](uint32_t x) { return x ^ 0x80000000u; }); break;
      case kAbs: Map(du, au, n, [](uint32_t x) { return x & 0x7FFFFFFFu; }); break;
      case kSqrt: Map(df, af, n, [](float x) { return std::sqrt(x); }); break;
      case kSign:
        Map(du, au, n, [](uint32_t x) {
          const float f = WithBits(x);
          const uint32_t one_or_zero = f != 0.0f ? 0x3F800000u : 0u;  // 1.0f or +0.0f
          return f != f ? x : (one_or_zero | (x & 0x80000000u));
        });
        break;
      case kXor: Map(du, au, bu, n, [](uint32_t x, uint32_t y) { return x ^ y; }); break;
      case kAnd: Map(du, au, bu, n, [](uint32_t x, uint32_t y) { return x & y; }); break;
      case kOr: Map(du, au, bu, n, [](uint32_t x, uint32_t y) { return x | y; }); break;
      case kLt: Map(du, af, bf, n, [](float x, float y) { return uint32_t{x < y}; }); break;
      case kLe: Map(du, af, bf, n, [](float x, float y) { return uint32_t{x <= y}; }); break;
      case kGt: Map(du, af, bf, n, [](float x, float y) { return uint32_t{x > y}; }); break;
      case kGe: Map(du, af, bf, n, [](float x, float y) { return uint32_t{x >= y}; }); break;
      case kEq: Map(du, af, bf, n, [](float x, float y) { return uint32_t{x == y}; }); break;
      case kNe: Map(du, af, bf, n, [](float x, float y) { return uint32_t{x != y}; }); break;
      case kSelect: {
        LaneU* __restrict__ out = du;
        const LaneU* __restrict__ pred = au;
        const LaneU* __restrict__ if_false = bu;
        const LaneU* __restrict__ if_true = cu;
        for (int64_t j = 0; j < n; ++j) out[j] = pred[j] != 0 ? if_true[j] : if_false[j];
        break;
      }
      case kNot: Map(du, au, n, [](uint32_t x) { return x ^ 1u; }); break;
      case kBoolToF32: Map(df, au, n, [](uint32_t x) { return x != 0 ? 1.0f : 0.0f; }); break;
      case kFma:
      case kFms:
      case kFnma: {
        LaneF* __restrict__ out = df;
        const LaneF* __restrict__ x = af;
        const LaneF* __restrict__ y = bf;
        const LaneF* __restrict__ z = cf;
        const float sign_x = op.code == kFnma ? -1.0f : 1.0f;  // exact: a sign flip
        const float sign_z = op.code == kFms ? -1.0f : 1.0f;
        for (int64_t j = 0; j < n; ++j) out[j] = std::fma(sign_x * x[j], y[j], sign_z * z[j]);
        break;
      }
      case kRowSum: {
        std::memcpy(scratch, af, sizeof(float) * n);
        df[0] = PairwiseSum(scratch, n);
        break;
      }
      case kBroadcast: {
        const uint32_t v = au[0];
        for (int64_t j = 0; j < n; ++j) du[j] = v;
        break;
      }
      default: break;  // checked before the rows run
    }
  }
}

// A checked view of a program (`row_program.py`'s `Program.code`).
struct Program {
  int64_t num_regs, num_prologue, num_row_ops, out_reg, num_slots;
  const int32_t* slot_regs;
  const Op* prologue;
  const Op* row_ops;
  std::vector<char> uniform;  // whether a register is written by the prologue
  std::vector<char> read;     // whether a register is read by an op
  std::vector<char> one_lane_write;  // whether a register is written only on lane 0
  // The row ops in runs of one-lane ops and of row-wide ops (the flag stripped).
  std::vector<Op> ops;
  struct Run {
    int64_t begin, end;
    bool one_lane;
  };
  std::vector<Run> runs;
  bool per_row = false;  // a per-row value or row sum: each row runs as one chunk
};

ffi::Error ReadProgram(ffi::Span<const int32_t> code, int64_t num_slots, int64_t num_scalars,
                       Program& p) {
  const int64_t size = static_cast<int64_t>(code.size());
  if (size < kHeader) return ffi::Error::InvalidArgument("the program has no header");
  const int32_t* c = code.begin();
  p.num_regs = c[0];
  p.num_prologue = c[1];
  p.num_row_ops = c[2];
  p.out_reg = c[3];
  p.num_slots = c[4];
  if (p.num_slots != num_slots || p.num_regs < kInputRegs + num_slots || p.num_prologue < 0 ||
      p.num_row_ops < 0 ||
      size != kHeader + num_slots + kOpWidth * (p.num_prologue + p.num_row_ops)) {
    return ffi::Error::InvalidArgument("the program's header does not match its call");
  }
  p.slot_regs = c + kHeader;
  p.prologue = reinterpret_cast<const Op*>(c + kHeader + num_slots);
  p.uniform.assign(p.num_regs, 0);
  p.read.assign(p.num_regs, 0);
  const auto valid = [&](int64_t r) { return r >= 0 && r < p.num_regs; };
  p.one_lane_write.assign(p.num_regs, 1);
  p.ops.assign(p.prologue, p.prologue + p.num_prologue + p.num_row_ops);
  for (int64_t i = 0; i < p.num_prologue + p.num_row_ops; ++i) {
    Op& op = p.ops[i];
    const bool one_lane = (op.code & kOneLane) != 0;
    if (one_lane && i < p.num_prologue) {
      return ffi::Error::InvalidArgument("the program has a one-lane op in its prologue");
    }
    op.code &= ~kOneLane;
    if (i >= p.num_prologue) {
      const int64_t k = i - p.num_prologue;
      if (p.runs.empty() || p.runs.back().one_lane != one_lane) p.runs.push_back({k, k, one_lane});
      p.runs.back().end = k + 1;
      p.per_row = p.per_row || one_lane || op.code == kRowSum || op.code == kBroadcast;
    }
    if (op.code < 0 || op.code >= kNumOps || !valid(op.dst) || op.dst < kInputRegs + num_slots) {
      return ffi::Error::InvalidArgument("the program has an unknown op or register");
    }
    if (i >= p.num_prologue && !one_lane && op.code != kRowSum) p.one_lane_write[op.dst] = 0;
    const bool reads_a = op.code != kConst && op.code != kScalar;
    if ((reads_a && !valid(op.a)) || !valid(op.b) || !valid(op.c) ||
        (op.code == kScalar && (op.a < 0 || op.a >= num_scalars))) {
      return ffi::Error::InvalidArgument("the program reads an unknown register or scalar");
    }
    if (i < p.num_prologue) p.uniform[op.dst] = 1;
    if (reads_a) p.read[op.a] = 1;  // b and c too (an op that does not read them names 0)
    p.read[op.b] = p.read[op.c] = 1;
  }
  p.prologue = p.ops.data();
  p.row_ops = p.ops.data() + p.num_prologue;
  if (!valid(p.out_reg)) return ffi::Error::InvalidArgument("the program's output is unknown");
  for (int64_t k = 0; k < num_slots; ++k) {
    if (!valid(p.slot_regs[k])) return ffi::Error::InvalidArgument("a slot's output is unknown");
  }
  return ffi::Error::Success();
}

// Inputs: rows s32 (nse,), values (f32, bf16 or f16, (nse, ...)), param f32 (its own
// shape; empty where the rule does not read it), scalars u32 (the program's scalars'
// bits), then each slot table (f32, the parameter's shape, or (num_rows,) for a
// per-row slot). Attributes: num_rows, program.
// Outputs: the distinct rows then padding, the rows' results (f32), each slot table
// (aliased to its input).
//
// One pass over the distinct rows (the table rows they touch prefetched): a row's
// gradient entries summed into the output, then the program run over the row in chunks
// of kChunk columns (the whole row with per-row values). A chunk's input registers are
// the rows where they lie (the summed gradient in the output, the parameter's and each
// slot's row in their tables: nothing is staged); its other registers are thread-local
// and stay in L1; at the chunk's end the new slot values are written into the slot
// tables and the rule's values over the gradient's sums.
ffi::Error RowProgramImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                          ffi::Buffer<ffi::F32> param, ffi::Buffer<ffi::U32> scalars,
                          ffi::RemainingArgs slots, int64_t num_rows,
                          ffi::Span<const int32_t> code, ffi::ThreadPool pool,
                          ffi::ResultBuffer<ffi::S32> distinct_rows,
                          ffi::ResultBuffer<ffi::F32> out, ffi::RemainingRets slots_out) {
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  if (nse == 0 || num_rows <= 0) return ffi::Error::InvalidArgument("no entries or no rows");
  const int64_t row_size = RowSize(values.element_count(), nse);
  if (row_size <= 0) return ffi::Error::InvalidArgument("values must hold nse rows");
  const int64_t num_slots = static_cast<int64_t>(slots.size());
  if (static_cast<int64_t>(slots_out.size()) != num_slots) {
    return ffi::Error::InvalidArgument("one output per slot table");
  }
  Program p;
  if (ffi::Error e = ReadProgram(code, num_slots, scalars.element_count(), p); e.failure()) {
    return e;
  }
  const bool has_param = param.element_count() != 0;
  if (has_param && static_cast<int64_t>(param.element_count()) != num_rows * row_size) {
    return ffi::Error::InvalidArgument("param must hold num_rows rows of the values' size");
  }
  std::vector<float*> tables;  // the parameter (read only), then each slot (updated)
  std::vector<int64_t> table_row_size;  // row_size, or 1 for a per-row slot
  tables.push_back(has_param ? const_cast<float*>(param.typed_data()) : nullptr);
  table_row_size.push_back(row_size);
  for (int64_t k = 0; k < num_slots; ++k) {
    auto in = slots.get<ffi::AnyBuffer>(k);
    auto result = slots_out.get<ffi::AnyBuffer>(k);
    const int64_t count = in.has_value() ? static_cast<int64_t>(in->element_count()) : -1;
    if (!in.has_value() || !result.has_value() || in->element_type() != ffi::DataType::F32 ||
        (count != num_rows * row_size && count != num_rows)) {
      return ffi::Error::InvalidArgument(
          "each slot must be a float32 table of the param's rows, or of one value a row");
    }
    CopyIfNotAliased(*in, *result);  // without donation XLA gives a fresh output buffer
    tables.push_back(static_cast<float*>((*result)->untyped_data()));
    table_row_size.push_back(count == num_rows * row_size ? row_size : 1);
    // A per-row slot's values are per-row registers: each row runs as one chunk.
    p.per_row = p.per_row || table_row_size.back() != row_size;
  }
  if (!has_param && p.read[kInputRegs - 1]) {
    return ffi::Error::InvalidArgument("the program reads the parameter's rows: give param");
  }
  // The tables whose rows are prefetched: the parameter's if the program reads it, each slot's.
  std::vector<char> prefetched(tables.size());
  for (size_t k = 0; k < tables.size(); ++k) {
    prefetched[k] = tables[k] != nullptr && (k > 0 || p.read[kInputRegs - 1]);
  }
  // The chunk's outputs: each slot's new values into its table, then the rule's values
  // over the gradient's sums (register 0). An output whose value is another input
  // register (a rule that stores the gradient in a slot, say) is copied aside before any
  // output is written; one whose value is its own input register is not written.
  struct Output {
    int64_t src, dst;  // registers: the value, the input register it replaces
    bool one_lane;     // a per-row slot's value
  };
  std::vector<Output> outputs;
  const int64_t num_inputs = kInputRegs + num_slots;
  for (int64_t k = 0; k < num_slots; ++k) {
    outputs.push_back({p.slot_regs[k], kInputRegs + k, table_row_size[1 + k] != row_size});
  }
  outputs.push_back({p.out_reg, 0, false});
  std::vector<Output> writes, staged;  // staged: src an input register, copied aside first
  for (const Output& o : outputs) {
    if (o.src == o.dst) continue;
    (o.src < num_inputs ? staged : writes).push_back(o);
  }
  // An output computed into a register of its own whose destination is read by no op after
  // that register's first write (nor by a staged output) is computed in place: the
  // register is the destination's lanes, and nothing is copied.
  std::vector<Output> in_place, copied;
  for (const Output& o : writes) {
    // A per-row slot's lane lies in its table: only ops on lane 0 may write it there.
    bool ok = !p.uniform[o.src] && (!o.one_lane || p.one_lane_write[o.src]);
    for (const Output& other : outputs) ok = ok && (&other == &o || other.src != o.src);
    for (const Output& other : staged) ok = ok && other.src != o.dst;
    int64_t first_write = -1, last_read = -1;
    for (int64_t i = 0; i < p.num_row_ops; ++i) {
      const Op& op = p.row_ops[i];
      if (op.dst == o.src && first_write < 0) first_write = i;
      const int arity = Arity(op.code);
      if ((arity > 0 && op.a == o.dst) || (arity > 1 && op.b == o.dst) ||
          (arity > 2 && op.c == o.dst)) {
        last_read = i;
      }
    }
    // An op may read the destination and write the register (lane by lane, in place).
    ok = ok && first_write >= 0 && last_read <= first_write;
    (ok ? in_place : copied).push_back(o);
  }
  // Lanes of a register: a chunk of kChunk columns, or the whole row where the program has
  // per-row values (a row's sum needs the whole row, and a per-row value is computed, and
  // its slot written, once a row).
  const int64_t width = p.per_row ? std::max<int64_t>(row_size, 1) : kChunk;
  const int64_t uniform_width = std::max(width, kChunk);
  // The prologue: every row's uniform values, once, chunk-wide.
  std::vector<uint32_t> uniform_lanes(p.num_regs * uniform_width);
  std::vector<uint32_t*> uniform_reg(p.num_regs);
  for (int64_t r = 0; r < p.num_regs; ++r) {
    uniform_reg[r] = uniform_lanes.data() + r * uniform_width;
  }
  RunOps<0>(p.prologue, p.num_prologue, uniform_reg.data(), uniform_width, scalars.typed_data(),
            nullptr);

  float* g = out->typed_data();
  int32_t* unique_rows = distinct_rows->typed_data();
  const size_t row_bytes = sizeof(float) * row_size;
  return WithValues(values, [&](const auto* vals) {
    // `ForEachCoalescedRow`'s chunks of distinct rows.
    std::vector<uint32_t> sorted_rows, position;
    const int64_t n_in_range = SortRows(rows.typed_data(), nse, num_rows, sorted_rows, position);
    const std::vector<int64_t> starts = RunStarts(sorted_rows, n_in_range);
    const int64_t num_unique = static_cast<int64_t>(starts.size()) - 1;
    const int64_t num_chunks = std::max<int64_t>(
        1, std::min<int64_t>(num_unique, kChunksPerThread * (pool.num_threads() + 1)));
    auto run_chunk = [&](int64_t chunk) {
      const int64_t begin = num_unique * chunk / num_chunks;
      const int64_t end = num_unique * (chunk + 1) / num_chunks;
      // The registers past the inputs: the prologue's (shared) or this thread's; then
      // one aside per staged output.
      thread_local std::vector<uint32_t> local;
      thread_local std::vector<uint32_t*> reg;
      thread_local std::vector<float> scratch;  // a row's sum
      local.resize((p.num_regs + staged.size()) * width);
      reg.resize(p.num_regs);
      scratch.resize(width);
      for (int64_t r = num_inputs; r < p.num_regs; ++r) {
        reg[r] = p.uniform[r] ? uniform_reg[r] : local.data() + r * width;
      }
      uint32_t* aside = local.data() + p.num_regs * width;
      for (int64_t s = begin; s < end; ++s) {
        if (s + kPrefetchRows < end) {
          const int64_t ahead = s + kPrefetchRows;
          const int64_t row = sorted_rows[starts[ahead]];
          for (size_t k = 0; k < tables.size(); ++k) {
            const int64_t size = table_row_size[k];
            if (prefetched[k]) PrefetchRow(tables[k] + row * size, size);
          }
          PrefetchEntries(vals, position.data(), starts[ahead], starts[ahead + 1], row_size);
        }
        const int64_t row = sorted_rows[starts[s]];
        unique_rows[s] = static_cast<int32_t>(row);
        float* sums = g + s * row_size;
        SumEntries(sums, vals, position.data(), starts[s], starts[s + 1], row_size);
        for (int64_t j = 0; j < row_size; j += width) {
          const int64_t n = std::min(width, row_size - j);
          reg[0] = reinterpret_cast<uint32_t*>(sums + j);
          for (size_t k = 0; k < tables.size(); ++k) {  // the parameter (or none), each slot
            const int64_t size = table_row_size[k];  // (a per-row slot: j is 0)
            reg[1 + k] = tables[k] == nullptr
                             ? nullptr
                             : reinterpret_cast<uint32_t*>(tables[k] + row * size + j);
          }
          for (const Output& o : in_place) reg[o.src] = reg[o.dst];
          const uint32_t* s = scalars.typed_data();
          for (const Program::Run& run : p.runs) {
            const Op* ops = p.row_ops + run.begin;
            const int64_t count = run.end - run.begin;
            if (run.one_lane) {
              RunOps<1>(ops, count, reg.data(), 1, s, scratch.data());
            } else if (n == kChunk) {
              RunOps<kChunk>(ops, count, reg.data(), n, s, scratch.data());
            } else {
              RunOps<0>(ops, count, reg.data(), n, s, scratch.data());
            }
          }
          for (size_t o = 0; o < staged.size(); ++o) {
            const int64_t lanes = staged[o].one_lane ? 1 : n;
            std::memcpy(aside + o * width, reg[staged[o].src], sizeof(uint32_t) * lanes);
          }
          for (size_t o = 0; o < staged.size(); ++o) {
            const int64_t lanes = staged[o].one_lane ? 1 : n;
            std::memcpy(reg[staged[o].dst], aside + o * width, sizeof(uint32_t) * lanes);
          }
          for (const Output& o : copied) {
            std::memcpy(reg[o.dst], reg[o.src], sizeof(uint32_t) * (o.one_lane ? 1 : n));
          }
        }
      }
    };
    ParallelFor(pool, num_chunks, num_unique * row_size, run_chunk);
    for (int64_t s = num_unique; s < nse; ++s) unique_rows[s] = static_cast<int32_t>(num_rows + s);
    std::memset(g + num_unique * row_size, 0, row_bytes * (nse - num_unique));
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaRowProgram, RowProgramImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("num_rows")
                                  .Attr<ffi::Span<const int32_t>>("program")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());
