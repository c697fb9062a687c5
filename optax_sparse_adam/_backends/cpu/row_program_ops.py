"""A rule's traced row math compiled to the row program's op list (`row_program.cc` runs it).

`compile_jaxpr` translates a jaxpr of one row block (the gradient's, the
parameter's and each slot's rows, then scalars) equation by equation into ops
over row-wide registers: uniform values (scalars, constants) into a prologue
run once a call, row values into the ops run on each row. It reproduces what
XLA does to the same math: a division by a constant is a product by its
inverse; under jit a product used only by one sum is contracted into it (an
FMA). An equation of uniform values alone that the kernel does not know
(`pow`, `exp`, an int->float conversion, an integer comparison, a sum of a
product of scalars, ...) is hoisted: XLA computes it before the kernel, from
the same scalars and by the same primitive, and the kernel reads it as one
more scalar (`Program.hoisted`, `hoisted_scalars`). Values of one per row
(`(n,)`, `(n, 1)`: a per-row slot's, a row's sum) are per-row registers, whose
ops run on one lane; a broadcast over the row is one op, and `osa.row_sum`
(its `jax.jit`, named `ROW_SUM_NAME`) is one reduction op. It refuses
(`Refused`) any primitive the kernel does not know on row values
(`reduce_sum`: use `osa.row_sum`) and any product of the rule's own summed
unrounded into a row or into a row sum (whether XLA contracts it depends on
its fusions). Dead ops are dropped and row registers reused (an output's
register is its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from optax_sparse_adam._core.row_sum import ROW_SUM_NAME

# Op codes: `OpCode` in row_program.cc (each op is 5 ints: code, dst, a, b, c).
_CONST, _SCALAR, _COPY = 0, 1, 2
_BINARY = {"add": 3, "sub": 4, "mul": 5, "div": 6, "max": 7, "min": 8}
_UNARY = {"neg": 9, "abs": 10, "sqrt": 11, "sign": 12}
_BITS = {"xor": 13, "and": 14, "or": 15}
_COMPARE = {"lt": 16, "le": 17, "gt": 18, "ge": 19, "eq": 20, "ne": 21}
_SELECT, _NOT, _BOOL_TO_F32 = 22, 23, 24
# Fused multiply-adds, as XLA:CPU contracts a product into its one sum under jit:
# a * b + c, a * b - c, c - a * b (each rounded once).
_FMA, _FMS, _FNMA = 25, 26, 27
# A per-row value: a row's sum (`osa.row_sum`: lane 0 of dst = the pairwise sum of a's
# lanes), and a per-row value broadcast over the row (every lane of dst = lane 0 of a).
_ROW_SUM, _BROADCAST = 28, 29
# Flags an op on per-row values: run on one lane (the kernel strips it from the code).
_ONE_LANE = 256
OP_WIDTH = 5
# Header: num_regs, num_prologue_ops, num_row_ops, out_reg, num_slots, then each slot's reg.
_INPUT_REGS = 2  # 0: the row's summed gradient, 1: the parameter's row; then each slot's row

_F32, _I32, _U32, _BOOL = (jnp.dtype(t) for t in (jnp.float32, jnp.int32, jnp.uint32, jnp.bool_))
# Primitives that pass their operand's bits through (a no-op on 32-bit lanes).
_PASS = ("copy", "copy_p", "optimization_barrier")
# A value's kind: the same in every lane (a scalar), one value a row (`(n,)`, `(n, 1)`),
# or a row's values (the block's shape, or the row flattened).
UNIFORM, PER_ROW, ROW = "uniform", "per_row", "row"
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or")


class Recipe(NamedTuple):
  """How XLA computes a uniform value: `primitive` bound to `args` (recipes) with `params`;
  a call's k-th scalar where `primitive` is None and `params` is k; a constant where
  `primitive` is None and `params` is a 0-d NumPy array."""

  primitive: Any
  params: Any
  args: tuple[Recipe, ...] = ()


class Program(NamedTuple):
  """A compiled row program: the kernel's int32 op list, how many scalars it reads (the
  call's, then the hoisted ones), and the recipes of the hoisted scalars."""

  code: tuple[int, ...]
  num_scalars: int
  hoisted: tuple[Recipe, ...] = ()


def hoisted_scalars(program: Program, scalars: Sequence[Any]) -> list[Any]:
  """The values of `program`'s hoisted scalars, computed by XLA from the call's `scalars`
  (each in its own dtype), primitive by primitive as the rule's update computes them."""
  memo: dict[int, Any] = {}

  def value(recipe: Recipe) -> Any:
    if id(recipe) not in memo:
      if recipe.primitive is None:
        params = recipe.params
        memo[id(recipe)] = scalars[params] if isinstance(params, int) else params
      else:
        args = [value(a) for a in recipe.args]
        memo[id(recipe)] = recipe.primitive.bind(*args, **dict(recipe.params))
    return memo[id(recipe)]

  return [value(r) for r in program.hoisted]


class Refused(Exception):
  """The rule's update has an equation the row program does not run (the message says which)."""


class _Compiler:
  """Translates a jaxpr of one row block into ops over registers of one row's width."""

  def __init__(self, row_shape: tuple[int, ...], jit: bool):
    self.row_shape = row_shape  # (n, *dense_shape): a row value; () is a uniform scalar
    # XLA divides by a constant as a product with its inverse (under jit and op by op: the
    # constant is part of the op), and under jit contracts a product into the one sum that
    # uses it (an FMA); the program does the same.
    self.jit = jit
    self.value: dict[int, np.float32] = {}  # registers of constants known now (float32)
    self.num_regs = 0
    self.prologue: list[list[int]] = []  # ops on uniform values: run once a call
    self.row_ops: list[list[int]] = []  # ops on row values: run on each row
    self.reg: dict[Any, int] = {}
    self.uniform: dict[int, bool] = {}
    self.product: set[int] = set()  # registers holding an unrounded product
    self.sums: list[tuple[int, int]] = []  # (a sum's register, its product operand)
    self.inverse: set[int] = set()  # products by a constant's inverse (XLA's divisions)
    self.recipe: dict[int, Recipe] = {}  # how XLA computes each uniform register
    # ... and each uniform variable: a conversion that keeps the bits shares its operand's
    # register, not its recipe (a bitcast to int32 is bound as one, before an XOR).
    self.var_recipe: dict[Any, Recipe] = {}
    self.hoisted: list[Recipe] = []  # uniform values XLA computes before the kernel
    self.first_hoisted = 0  # the scalar index of the first hoisted value
    self.per_row: set[int] = set()  # registers of one value a row (lane 0)
    self.out_kind = ROW  # the kind of the equation being translated (`emit`'s registers)

  def row_ops_or_prologue(self, dst: int) -> list[int]:
    """The op that writes register `dst`."""
    for op in self.prologue if self.uniform[dst] else self.row_ops:
      if op[1] == dst:
        return op
    raise AssertionError(dst)

  def contract(self, outs: Sequence[int]) -> None:
    """Each sum of a product used by nothing else, as one FMA (XLA:CPU's contraction)."""
    uses: dict[int, int] = {}
    for op in (*self.prologue, *self.row_ops):
      for r in _reads(op):
        uses[r] = uses.get(r, 0) + 1
    for r in outs:
      uses[r] = uses.get(r, 0) + 1
    for dst, product in self.sums:
      if uses.get(product, 0) != 1 or self.uniform[product] != self.uniform[dst]:
        continue
      op = self.row_ops_or_prologue(dst)
      mul = self.row_ops_or_prologue(product)
      x, y = mul[2], mul[3]
      if op[0] == _BINARY["add"]:
        other = op[3] if op[2] == product else op[2]
        op[:] = [_FMA, dst, x, y, other]
      elif op[2] == product:  # product - c
        op[:] = [_FMS, dst, x, y, op[3]]
      else:  # c - product
        op[:] = [_FNMA, dst, x, y, op[2]]
      self.value.pop(dst, None)

  def new(self, uniform: bool, per_row: bool = False) -> int:
    r = self.num_regs
    self.num_regs += 1
    self.uniform[r] = uniform
    if per_row and not uniform:
      self.per_row.add(r)
    return r

  def emit(self, code: int, uniform: bool, *args: int, per_row: bool | None = None) -> int:
    """A new register written by op `code` on `args`: per-row where `per_row` says so
    (None: where the equation being translated gives a per-row value)."""
    dst = self.new(uniform, self.out_kind == PER_ROW if per_row is None else per_row)
    op = [code, dst, *args, *(0,) * (OP_WIDTH - 2 - len(args))]
    (self.prologue if uniform else self.row_ops).append(op)
    return dst

  def binary(self, name: str, uniform: bool, a: int, b: int) -> int:
    if name == "div" and b in self.value and a not in self.value:
      # XLA's algebraic simplifier: A / constant -> A * (1 / constant), the inverse in float32.
      inverse = np.float32(1) / self.value[b]
      b = self.constant(inverse, _F32)
      dst = self.emit(_BINARY["mul"], uniform, a, b)
      self.inverse.add(dst)
      return dst
    dst = self.emit(_BINARY[name], uniform, a, b)
    if a in self.value and b in self.value:
      x, y = self.value[a], self.value[b]
      with np.errstate(all="ignore"):
        self.value[dst] = {
          "add": np.add,
          "sub": np.subtract,
          "mul": np.multiply,
          "div": np.divide,
        }.get(name, lambda x, y: np.float32(np.nan))(x, y)
      if name in ("max", "min"):
        del self.value[dst]
    return dst

  def read(self, atom: Any) -> int:
    if isinstance(atom, jex_core.Literal):
      value = np.asarray(atom.val)
      if value.shape != ():
        raise Refused(f"a constant of shape {value.shape}")
      return self.constant(value, value.dtype)
    return self.reg[atom]

  def constant(self, value: Any, dtype: Any) -> int:
    dtype = jnp.dtype(dtype)
    if dtype == _F32:
      bits = int(np.asarray(value, np.float32).view(np.int32))
    elif dtype in (_I32, _U32, _BOOL):
      bits = int(np.asarray(value).astype(np.uint32).view(np.int32))
    else:
      raise Refused(f"a constant of dtype {dtype}")
    r = self.emit(_CONST, True, bits)
    self.recipe[r] = Recipe(None, np.asarray(value, dtype))
    if dtype == _F32:
      self.value[r] = np.float32(value)
    return r

  def kind(self, aval: Any) -> str:
    """`UNIFORM`, `PER_ROW` or `ROW` (the row's values, in any shape `(n, ...)` of the row's
    size: a reshape keeps the row-major order); refuses a shape that is none of them."""
    shape = tuple(aval.shape)
    if shape == ():
      return UNIFORM
    n, row_size = self.row_shape[0], int(np.prod(self.row_shape[1:], dtype=np.int64))
    if shape[0] == n and int(np.prod(shape[1:], dtype=np.int64)) == row_size:
      return ROW  # a row of one value is a per-row value too: one lane either way
    if shape[0] == n and int(np.prod(shape[1:], dtype=np.int64)) == 1:
      return PER_ROW
    raise Refused(f"a value of shape {shape} (a block is {self.row_shape})")

  def broadcast(self, r: int) -> int:
    """Per-row register `r` broadcast over the row: an unrounded product stays one (XLA may
    contract it, broadcast, into a sum; the sum then refuses it)."""
    if r not in self.per_row:
      return r  # uniform: every lane holds it already
    dst = self.emit(_BROADCAST, False, r, per_row=False)
    if r in self.product:
      self.product.add(dst)
    return dst

  def row_sum(self, eqn: Any) -> None:
    """`osa.row_sum`: one reduction op over the whole row (`PairwiseSum`'s order)."""
    (x,) = eqn.invars
    (out,) = eqn.outvars
    if self.kind(x.aval) != ROW or self.kind(out.aval) != (
      ROW if self.row_shape[1:] and np.prod(self.row_shape[1:]) == 1 else PER_ROW
    ):
      raise Refused(f"osa.row_sum of shape {tuple(x.aval.shape)} (a block is {self.row_shape})")
    a = self.read(x)
    if int(np.prod(self.row_shape[1:], dtype=np.int64)) == 1:
      self.reg[out] = a  # one value: the sum is the value itself, as XLA's slice is
      return
    if a in self.product and self.jit:
      raise Refused(
        "an unrounded product feeds osa.row_sum (under jit XLA may contract it into the "
        "sum's first adds, depending on its fusions; give row_sum opaque_zero=block.opaque_zero "
        "to round it where it stands)"
      )
    self.reg[out] = self.emit(_ROW_SUM, False, a, per_row=True)

  def run(self, jaxpr: Any, regs: Sequence[int]) -> list[int]:
    for var, r in zip(jaxpr.invars, regs, strict=True):
      self.reg[var] = r
    for eqn in jaxpr.eqns:
      self.equation(eqn)
    return [self.read(v) for v in jaxpr.outvars]

  def inline(self, closed: Any, eqn: Any) -> None:
    inner = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    consts = getattr(closed, "consts", ())
    if consts:
      raise Refused(f"{eqn.primitive.name} closes over arrays")
    for inner_var, var in zip(inner.invars, eqn.invars, strict=True):
      if (recipe := self.recipe_of(var)) is not None:
        self.var_recipe[inner_var] = recipe
    outs = _Compiler.run(self, inner, [self.read(v) for v in eqn.invars])
    for var, inner_var, r in zip(eqn.outvars, inner.outvars, outs, strict=True):
      self.reg[var] = r
      if (recipe := self.recipe_of(inner_var)) is not None:
        self.var_recipe[var] = recipe

  def recipe_of(self, atom: Any) -> Recipe | None:
    """How XLA computes a uniform variable (or literal), or None."""
    if isinstance(atom, jex_core.Literal):
      return self.recipe[self.read(atom)]
    if atom in self.var_recipe:
      return self.var_recipe[atom]
    return self.recipe.get(self.reg[atom])

  def equation(self, eqn: Any) -> None:
    name = eqn.primitive.name
    params = eqn.params
    if name in ("pjit", "jit") and params.get("name") == ROW_SUM_NAME:
      return self.row_sum(eqn)
    if name in ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"):
      return self.inline(params.get("jaxpr") or params["call_jaxpr"], eqn)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
      return self.inline(params.get("call_jaxpr") or params["fun_jaxpr"], eqn)
    uniform = len(eqn.outvars) == 1 and all(
      np.shape(v.aval) == () for v in (*eqn.invars, *eqn.outvars)
    )
    in_recipes = [self.recipe_of(v) for v in eqn.invars] if uniform else []
    if not uniform or any(r is None for r in in_recipes):
      return self.translate(eqn)
    recipe = Recipe(eqn.primitive, tuple(params.items()), tuple(in_recipes))  # type: ignore[arg-type]
    try:
      self.translate(eqn)
    except Refused:
      # A uniform value the kernel does not compute (as XLA would): XLA computes it before
      # the kernel, by the same primitive from the same values (`hoisted_scalars`).
      if jnp.dtype(eqn.outvars[0].aval.dtype) not in (_F32, _I32, _U32, _BOOL):
        raise
      self.reg[eqn.outvars[0]] = self.emit(_SCALAR, True, self.first_hoisted + len(self.hoisted))
      self.hoisted.append(recipe)
    self.var_recipe[eqn.outvars[0]] = recipe
    self.recipe.setdefault(self.reg[eqn.outvars[0]], recipe)

  def translate(self, eqn: Any) -> None:
    """Emits the ops of one equation (not a call), or `Refused`."""
    name = eqn.primitive.name
    params = eqn.params
    (out,) = eqn.outvars if len(eqn.outvars) == 1 else (None,)
    if out is None:
      raise Refused(f"{name} with {len(eqn.outvars)} outputs")
    if name == "reduce_sum":
      raise Refused(
        "the primitive 'reduce_sum' (jnp.sum or jnp.mean: XLA's own order of a sum; use "
        "osa.row_sum, the row program's fixed-order row sum, for the fast path)"
      )
    if name in _REDUCTIONS:
      raise Refused(f"the primitive {name!r} (a reduction the row program does not run)")
    kind = self.kind(out.aval)
    uniform = kind == UNIFORM
    out_dtype = jnp.dtype(out.aval.dtype)
    ins = [self.read(v) for v in eqn.invars]
    in_dtypes = [jnp.dtype(v.aval.dtype) for v in eqn.invars]
    in_kinds = [self.kind(v.aval) for v in eqn.invars]
    if out_dtype not in (_F32, _I32, _U32, _BOOL):
      raise Refused(f"{name} gives {out_dtype} (the row program runs 32-bit values)")
    if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
      return self.reshaped(eqn, ins[0], in_kinds[0], kind)
    self.out_kind = kind
    if kind == ROW:  # a per-row operand broadcast by the op (`(n, 1)` with `(n, D)`)
      ins = [self.broadcast(r) if k == PER_ROW else r for r, k in zip(ins, in_kinds, strict=True)]
    elif any(k not in (UNIFORM, kind) for k in in_kinds):
      raise Refused(f"{name} of shapes {[tuple(v.aval.shape) for v in eqn.invars]}")
    float_op = all(d == _F32 for d in in_dtypes) and out_dtype in (_F32, _BOOL)
    minus_one = [
      r for r in ins if r in self.value and np.float32(self.value[r]).view(np.uint32) == 0xBF800000
    ]
    if (
      name == "mul"
      and float_op
      and self.jit
      and minus_one
      and not all(r in self.value for r in ins)
    ):
      # Under jit LLVM may turn a product by -1 into a negation (a NaN's sign flipped), and
      # fold that into the op that uses it; op by op it stays a product.
      raise Refused(
        "a negation (a product by -1) of a value known only when the step runs (under jit "
        "LLVM may fold it into the op that uses it, which can change a NaN's sign)"
      )
    if name in _BINARY and float_op:
      products = [r for r in ins if r in self.product] if jit_sums(self) else []
      if name in ("add", "sub") and (
        len(products) > 1 or any(r not in self.inverse for r in products)
      ):
        # Verified bit for bit: a division by a constant, contracted into its sum. A
        # product of the rule's own is refused: whether XLA contracts it depends on its
        # fusions (FTRL rounds its products where they stand, `adam.rounded`).
        raise Refused(
          f"an unrounded product feeds {name} (XLA may contract it into a fused "
          "multiply-add under jit; round the product where it stands, `adam.rounded`)"
        )
      dst = self.binary(name, uniform, *ins)
      if name in ("add", "sub") and products:
        self.sums.append((dst, products[0]))  # an FMA where the product has no other use
      if self.row_ops_or_prologue(dst)[0] == _BINARY["mul"]:
        self.product.add(dst)
    elif name in _UNARY and float_op:
      if name == "neg" and ins[0] in self.product and self.jit:
        raise Refused("a negated unrounded product (XLA may contract it into a sum)")
      if name == "neg" and ins[0] not in self.value and self.jit and kind != PER_ROW:
        # (A per-row value's negation is computed once a row, broadcast after it: checked
        # bit for bit with NaN and inf entries, tests/backends/test_row_sum_program.py.)
        # Under jit LLVM folds a negation into the op that uses it (-x * c -> x * -c,
        # -x + y -> y - x, -x * y -> -(x * y)): the same numbers, but a NaN's sign then
        # depends on XLA's fusions, which the program cannot follow (maximize negates g).
        raise Refused(
          "a negation of a value known only when the step runs (under jit XLA folds it "
          "into the op that uses it, which can change a NaN's sign)"
        )
      dst = self.emit(_UNARY[name], uniform, *ins)
      if ins[0] in self.value and name in ("neg", "abs", "sqrt"):
        with np.errstate(all="ignore"):
          x = self.value[ins[0]]
          self.value[dst] = {"neg": np.negative, "abs": np.abs, "sqrt": np.sqrt}[name](x)
    elif name in _BITS and all(d in (_I32, _U32, _BOOL) for d in in_dtypes):
      dst = self.emit(_BITS[name], uniform, *ins)
    elif name == "not" and in_dtypes == [_BOOL]:
      dst = self.emit(_NOT, uniform, *ins)
    elif name in _COMPARE and all(d == _F32 for d in in_dtypes):
      dst = self.emit(_COMPARE[name], uniform, *ins)
    elif name == "select_n" and len(ins) == 3 and in_dtypes[0] == _BOOL:
      dst = self.emit(_SELECT, uniform, *ins)
    elif name == "integer_pow" and float_op and 1 <= params["y"] <= 4:
      dst = self.integer_pow(ins[0], params["y"], uniform)
    elif name == "square" and float_op:
      dst = self.binary("mul", uniform, ins[0], ins[0])
      self.product.add(dst)
    elif name in ("convert_element_type", "bitcast_convert_type", "reduce_precision"):
      dst = self.convert(name, eqn, ins[0], in_dtypes[0], out_dtype, uniform)
    elif name in _PASS:
      dst = ins[0]
    else:
      raise Refused(f"the primitive {name!r} on {[str(d) for d in in_dtypes]}")
    self.reg[out] = dst

  def reshaped(self, eqn: Any, a: int, in_kind: str, kind: str) -> None:
    """A broadcast or reshape: a scalar's register holds it in every lane, a row's lanes
    keep their order; a per-row value broadcast over the row is one op."""
    (out,) = eqn.outvars
    name = eqn.primitive.name
    if name == "broadcast_in_dim" and in_kind != UNIFORM:
      if tuple(eqn.params["broadcast_dimensions"])[:1] != (0,):
        raise Refused("broadcast_in_dim across rows")  # (n,) along the columns, say
    if in_kind == UNIFORM:
      dst = a
    elif in_kind == kind:
      dst = a  # the same lanes in the same order (a row of one value: `(n,)` to `(n, 1)`)
    elif in_kind == PER_ROW and kind == ROW and name == "broadcast_in_dim":
      dst = self.broadcast(a)
    else:
      raise Refused(f"{name} from shape {eqn.invars[0].aval.shape} to {out.aval.shape}")
    self.reg[out] = dst

  def integer_pow(self, x: int, y: int, uniform: bool) -> int:
    # `lax.integer_pow`'s lowering: square-and-multiply from the lowest bit.
    y_given = y
    acc = None
    while y > 0:
      if y & 1:
        acc = x if acc is None else self.emit(_BINARY["mul"], uniform, acc, x)
      y >>= 1
      if y > 0:
        x = self.emit(_BINARY["mul"], uniform, x, x)
    assert acc is not None
    if y_given > 1:
      self.product.add(acc)
      self.value.pop(acc, None)
    return acc

  def convert(self, name: str, eqn: Any, x: int, src: Any, dst: Any, uniform: bool) -> int:
    if name == "reduce_precision":
      if params_exact(eqn.params):
        return x
      raise Refused("reduce_precision below float32")
    if src == dst or (name == "bitcast_convert_type" and src != _BOOL and dst != _BOOL):
      return x  # the same 32 bits
    if name == "convert_element_type" and src in (_I32, _U32) and dst in (_I32, _U32):
      return x  # two's complement: the same bits
    if name == "convert_element_type" and src == _BOOL and dst == _F32:
      return self.emit(_BOOL_TO_F32, uniform, x)
    raise Refused(f"{name} from {src} to {dst}")


def jit_sums(c: _Compiler) -> bool:
  """Whether sums of products are contracted (and so checked): under jit only."""
  return c.jit


def params_exact(params: Any) -> bool:
  """Whether a `reduce_precision` keeps float32's bits (8 exponent, 23 mantissa bits)."""
  return params.get("exponent_bits") == 8 and params.get("mantissa_bits") == 23


def compile_jaxpr(
  jaxpr: Any,
  row_shape: tuple[int, ...],
  num_slots: int,
  num_scalars: int,
  jit: bool,
  zero_scalar: int,
  per_row_slots: Sequence[bool] = (),
) -> Program:
  """The program of `jaxpr` (of g, param, the slots, then the scalars; to the rows and the
  slots' new rows), or `Refused`. Scalar `zero_scalar` is the rounding zero; a slot of
  `per_row_slots` holds one value a row."""
  c = _Compiler(row_shape, jit)
  per_row = [False] * _INPUT_REGS + [bool(p) for p in per_row_slots]
  per_row += [False] * (_INPUT_REGS + num_slots - len(per_row))
  inputs = [c.new(False, p) for p in per_row]
  scalars = [c.emit(_SCALAR, True, k) for k in range(num_scalars)]
  c.recipe.update({r: Recipe(None, k) for k, r in enumerate(scalars)})
  c.first_hoisted = num_scalars
  outs = c.run(jaxpr.jaxpr, [*inputs, *scalars])
  fixed = set(inputs)
  # The new rows are copied out at the end of a row: never from a row input, which an
  # earlier copy of the same row may have overwritten (a rule that swaps two slots).
  outs = [_copy(c, r) if r in fixed else r for r in outs]
  if jit:
    c.contract(outs)
  outs = _without_barriers(c, scalars[zero_scalar], outs, fixed)
  for op in c.row_ops:  # the ops on per-row values run on one lane (a row's sum reads all)
    if op[1] in c.per_row and op[0] != _ROW_SUM:
      op[0] |= _ONE_LANE
  num_regs, prologue, row_ops, outs = _allocated(c, len(inputs), outs)
  header = (num_regs, len(prologue), len(row_ops), outs[0], num_slots, *outs[1:])
  code = header + tuple(v for op in (*prologue, *row_ops) for v in op)
  return Program(tuple(int(v) for v in code), num_scalars + len(c.hoisted), tuple(c.hoisted))


def _without_barriers(c: _Compiler, zero: int, outs: list[int], fixed: set[int]) -> list[int]:
  """The program without `adam.rounded`'s XORs with the rounding zero (identities on the
  bits, which kept XLA from contracting products: decided above); returns the outputs."""
  alias: dict[int, int] = {}
  for ops in (c.prologue, c.row_ops):
    for op in ops:
      if op[0] == _BITS["xor"] and zero in (op[2], op[3]):
        alias[op[1]] = op[3] if op[2] == zero else op[2]

  def source(r: int) -> int:
    while r in alias:
      r = alias[r]
    return r

  for ops in (c.prologue, c.row_ops):
    ops[:] = [op for op in ops if op[1] not in alias]
    for op in ops:
      n = len(_reads(op))
      op[2 : 2 + n] = [source(r) for r in op[2 : 2 + n]]
  outs = [source(r) for r in outs]
  # An output aliased back to an input (a rule returning a rounded input) is copied.
  return [_copy(c, r) if r in fixed else r for r in outs]


def _copy(c: _Compiler, r: int) -> int:
  """A copy of register `r` (of its kind)."""
  return c.emit(_COPY, c.uniform[r], r, per_row=r in c.per_row)


def _reads(op: Sequence[int]) -> list[int]:
  """The registers an op reads."""
  code = op[0] & ~_ONE_LANE
  if code in (_CONST, _SCALAR):
    return []
  if code in (_SELECT, _FMA, _FMS, _FNMA):
    return list(op[2:5])
  if code in (_COPY, *_UNARY.values(), _NOT, _BOOL_TO_F32, _ROW_SUM, _BROADCAST):
    return [op[2]]
  return list(op[2:4])


def _allocated(
  c: _Compiler, num_inputs: int, outs: list[int]
) -> tuple[int, list[list[int]], list[list[int]], list[int]]:
  """The program without dead ops, its registers renumbered: the inputs first, then the
  uniform values, then the row values, a row register reused once its value is dead."""
  live = set(outs)
  kept: list[list[int]] = []
  for op in reversed([*c.prologue, *c.row_ops]):
    if op[1] in live:
      kept.append(op)
      live.update(_reads(op))
  kept.reverse()
  prologue = [op for op in kept if c.uniform[op[1]]]
  row_ops = [op for op in kept if not c.uniform[op[1]]]
  number = {r: r for r in range(num_inputs)}
  for op in prologue:
    number[op[1]] = len(number)
  first_row = len(number)
  last_use: dict[int, int] = {}
  for i, op in enumerate(row_ops):
    for r in _reads(op):
      last_use[r] = i
  for r in outs:
    last_use[r] = len(row_ops)
  free: list[int] = []
  num_regs = first_row
  renumbered_rows = []
  outputs = set(outs)
  for i, op in enumerate(row_ops):
    # An output gets a register of its own: written by its op alone, the kernel can compute
    # it straight into its table (`row_program.cc`'s outputs in place).
    if free and op[1] not in outputs:
      number[op[1]] = free.pop()
    else:
      number[op[1]] = num_regs
      num_regs += 1
    for r in set(_reads(op)):
      if last_use.get(r) == i and number[r] >= first_row:
        free.append(number[r])
    renumbered_rows.append(op)

  def renumber(op: list[int]) -> list[int]:
    reads = _reads(op)
    new = list(op)
    new[1] = number[op[1]]
    for k, r in enumerate(op[2:5], start=2):
      if k - 2 < len(reads):
        new[k] = number[r]
    return new

  return (
    max(num_regs, first_row),
    [renumber(op) for op in prologue],
    [renumber(op) for op in renumbered_rows],
    [number[r] for r in outs],
  )
