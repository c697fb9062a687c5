"""The row program's format and the passes that finish it (`row_program.cc` reads it).

The op codes (`OpCode` in row_program.cc), a compiled `Program` with the
recipes of its hoisted scalars (`hoisted_scalars` computes them in XLA), and the
passes `row_program_ops.compile_jaxpr` runs on its drafted op list once the
rule is translated: `adam.rounded`'s XORs with the rounding zero dropped
(`without_barriers`), dead ops dropped and row registers reused (`allocated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

# Op codes: `OpCode` in row_program.cc (each op is 5 ints: code, dst, a, b, c).
CONST, SCALAR, COPY = 0, 1, 2
BINARY = {"add": 3, "sub": 4, "mul": 5, "div": 6, "max": 7, "min": 8}
UNARY = {"neg": 9, "abs": 10, "sqrt": 11, "sign": 12}
BITS = {"xor": 13, "and": 14, "or": 15}
COMPARE = {"lt": 16, "le": 17, "gt": 18, "ge": 19, "eq": 20, "ne": 21}
SELECT, NOT, BOOL_TO_F32 = 22, 23, 24
# Fused multiply-adds, as XLA:CPU contracts a product into its one sum under jit:
# a * b + c, a * b - c, c - a * b (each rounded once).
FMA, FMS, FNMA = 25, 26, 27
# A per-row value: a row's sum (`osa.row_sum`: lane 0 of dst = the pairwise sum of a's
# lanes), and a per-row value broadcast over the row (every lane of dst = lane 0 of a).
ROW_SUM, BROADCAST = 28, 29
# Flags an op on per-row values: run on one lane (the kernel strips it from the code).
ONE_LANE = 256
OP_WIDTH = 5
# Header: num_regs, num_prologue_ops, num_row_ops, out_reg, num_slots, then each slot's reg.
INPUT_REGS = 2  # 0: the row's summed gradient, 1: the parameter's row; then each slot's row


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


class Draft(Protocol):
  """A drafted op list (`row_program_ops._Compiler`): ops of 5 ints, code, dst, a, b, c."""

  prologue: list[list[int]]  # ops on uniform values: run once a call
  row_ops: list[list[int]]  # ops on row values: run on each row
  uniform: dict[int, bool]  # whether a register holds a uniform value
  per_row: set[int]  # registers of one value a row

  def emit(self, code: int, uniform: bool, *args: int, per_row: bool | None = None) -> int: ...


def without_barriers(c: Draft, zero: int, outs: list[int], fixed: set[int]) -> list[int]:
  """The program without `adam.rounded`'s XORs with the rounding zero (identities on the
  bits, which kept XLA from contracting products: decided above); returns the outputs."""
  alias: dict[int, int] = {}
  for ops in (c.prologue, c.row_ops):
    for op in ops:
      if op[0] == BITS["xor"] and zero in (op[2], op[3]):
        alias[op[1]] = op[3] if op[2] == zero else op[2]

  def source(r: int) -> int:
    while r in alias:
      r = alias[r]
    return r

  for ops in (c.prologue, c.row_ops):
    ops[:] = [op for op in ops if op[1] not in alias]
    for op in ops:
      n = len(registers_read(op))
      op[2 : 2 + n] = [source(r) for r in op[2 : 2 + n]]
  outs = [source(r) for r in outs]
  # An output aliased back to an input (a rule returning a rounded input) is copied.
  return [copy_of(c, r) if r in fixed else r for r in outs]


def copy_of(c: Draft, r: int) -> int:
  """A copy of register `r` (of its kind)."""
  return c.emit(COPY, c.uniform[r], r, per_row=r in c.per_row)


def registers_read(op: Sequence[int]) -> list[int]:
  """The registers an op reads."""
  code = op[0] & ~ONE_LANE
  if code in (CONST, SCALAR):
    return []
  if code in (SELECT, FMA, FMS, FNMA):
    return list(op[2:5])
  if code in (COPY, *UNARY.values(), NOT, BOOL_TO_F32, ROW_SUM, BROADCAST):
    return [op[2]]
  return list(op[2:4])


def allocated(
  c: Draft, num_inputs: int, outs: list[int]
) -> tuple[int, list[list[int]], list[list[int]], list[int]]:
  """The program without dead ops, its registers renumbered: the inputs first, then the
  uniform values, then the row values, a row register reused once its value is dead."""
  live = set(outs)
  kept: list[list[int]] = []
  for op in reversed([*c.prologue, *c.row_ops]):
    if op[1] in live:
      kept.append(op)
      live.update(registers_read(op))
  kept.reverse()
  prologue = [op for op in kept if c.uniform[op[1]]]
  row_ops = [op for op in kept if not c.uniform[op[1]]]
  number = {r: r for r in range(num_inputs)}
  for op in prologue:
    number[op[1]] = len(number)
  first_row = len(number)
  last_use: dict[int, int] = {}
  for i, op in enumerate(row_ops):
    for r in registers_read(op):
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
    for r in set(registers_read(op)):
      if last_use.get(r) == i and number[r] >= first_row:
        free.append(number[r])
    renumbered_rows.append(op)

  def renumber(op: list[int]) -> list[int]:
    reads = registers_read(op)
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
