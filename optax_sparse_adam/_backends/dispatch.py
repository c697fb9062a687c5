"""The one place that decides how a step runs: CPU kernels, the accelerator step, or XLA ops.

Both `masked_step` (the masked step of one parameter, under any rule) and
`scatter_add` (`apply_updates` of one parameter) come here. What can be decided
at trace time (dtypes, the rule, the plan's switches, `choice`) is decided here
in Python; what depends on the backend the step is lowered for is left to
`lax.platform_dependent`, so one traced step lowers to the CPU kernels (where
the rule has one that applies, else the generic XLA ops) on the CPU, to the
accelerator step (`accelerator`: one sort, no loop) on CUDA, ROCm and TPU, and
to the generic XLA ops (`xla`) on any other backend. Every path returns the
same results: on the CPU all three agree bit for bit (tests/backends), but for
the catch-up of idle rows, where the kernel agrees to float32 rounding.
`masked_steps` takes the tables of one update together: on CUDA, ROCm and TPU
they share one sort (`table_batched`); elsewhere each runs `masked_step`'s path.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam._backends import accelerator, choice, one_device, table_batched, xla
from optax_sparse_adam._backends.cpu import kernels, row_program, row_round
from optax_sparse_adam._backends.protocol import StepBackend
from optax_sparse_adam._core import bcoo, coalesce, rounding
from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan
from optax_sparse_adam._core.sharded import sharding


def masked_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """One parameter's masked step on the backend it is lowered for (see `xla.masked_step`)."""
  step = _bind(inputs, plan)
  return _by_backend(
    step.args,
    cpu=step.on_cpu,
    accelerator=step.runs(accelerator.masked_step),
    generic=step.runs(xla.masked_step),
  )


def masked_steps(steps: Sequence[tuple[StepInputs, StepPlan]]) -> list[RowsStep]:
  """Several parameters' masked steps (`masked_step` each), the tables batched on accelerators.

  On CUDA, ROCm and TPU (or forced, `choice.ACCELERATOR`) the tables share one
  sort (`table_batched.masked_steps`) unless `choice.PathChoice.batch_tables`
  is off; on the CPU and elsewhere each table runs the path `masked_step` picks
  for it (the CPU kernels where they apply), unchanged.
  """
  if len(steps) < 2 or not choice.current().batch_tables:
    return [masked_step(inputs, plan) for inputs, plan in steps]
  bound = [_bind(inputs, plan) for inputs, plan in steps]

  def each(run_of: Callable[[_Bound], Callable[..., RowsStep]]) -> Callable[..., list[RowsStep]]:
    def run(*args: Any) -> list[RowsStep]:
      return [run_of(b)(*a) for b, a in zip(bound, args, strict=True)]

    return run

  def batched(*args: Any) -> list[RowsStep]:
    return table_batched.masked_steps(
      [(b.inputs(*a), b.plan) for b, a in zip(bound, args, strict=True)]
    )

  return _by_backend(
    tuple(b.args for b in bound),
    cpu=each(lambda b: b.on_cpu),
    accelerator=batched,
    generic=each(lambda b: b.runs(xla.masked_step)),
  )


class _Bound(NamedTuple):
  """A step's traced arguments, how a backend gets its inputs back, and its CPU backend.

  The hyper-parameters that are arrays (a traced learning rate, a step size)
  travel as an argument: a backend must not close over them, or differentiating
  through the step would leak them out of `_differentiated_as`'s rule. Python
  floats stay closed over: constants, exact until used.
  """

  args: tuple
  inputs: Callable[..., StepInputs]
  plan: StepPlan
  on_cpu: Callable[..., RowsStep]  # of `args`: the CPU's path (`_on_cpu`)

  def runs(self, backend: StepBackend) -> Callable[..., RowsStep]:
    """`backend` as a function of `args`."""
    return lambda *args: backend(self.inputs(*args), self.plan)


def _bind(inputs: StepInputs, plan: StepPlan) -> _Bound:
  leaves, treedef = jax.tree.flatten(inputs.hyper)
  traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

  def rebound(inputs: StepInputs, arrays: list[jax.Array]) -> StepInputs:
    full = list(leaves)
    for i, array in zip(traced, arrays, strict=True):
      full[i] = array
    return inputs._replace(hyper=jax.tree.unflatten(treedef, full))

  args = (inputs._replace(hyper=None), [leaves[i] for i in traced])

  def runs(backend: StepBackend) -> Callable[..., RowsStep]:
    return lambda *args: backend(rebound(*args), plan)

  def kernels_path() -> Callable[..., RowsStep] | None:
    if kernels.step_applies(inputs, plan):  # the rule's fused kernel
      rounds = plan.config.param_rounding == "stochastic"
      return runs(_kernel_then_rounded if rounds else kernels.in_values_dtype)
    if kernels.generic_step_applies(inputs, plan):
      # Under jit XLA contracts the rule's products into sums; op by op (eagerly, also
      # under vmap or grad) it does not.
      jit = row_program.traced_into_jit(inputs.values)
      if kernels.gathers(inputs.values) and row_program.refusal(inputs, plan, jit=jit) is None:
        # An elementwise rule: its traced math run on each coalesced row by the generic
        # row program kernel, in the pass that coalesces, reads and stores the rows.
        return runs(functools.partial(row_program.masked_step, jit=jit))
      # Any rule: the rows coalesced and gathered by the generic kernel, the rule's math in
      # XLA ops, its tables' rows stored in place by the generic kernel.
      return runs(
        functools.partial(
          xla.masked_step,
          coalescer=kernels.coalesce_and_gather
          if kernels.gathers(inputs.values)
          else coalesce.coalesce_and_gather_rows_unmarked,
          store_rows=_kernel_store(plan.layout),
        )
      )
    return None

  arrays = (inputs.rows, inputs.values, inputs.tables)
  on_cpu = _on_cpu(kernels_path, arrays, runs(xla.masked_step))
  return _Bound(args, rebound, plan, on_cpu)


def _kernel_then_rounded(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The fused kernel's step, then its rows `w + delta` rounded stochastically.

  The kernel computes the delta `xla.masked_step` computes (bit for bit), which
  `xla.rounded_param_rows` turns into the same rounded rows as the XLA path; on
  a bfloat16 or float16 table those bits are computed by the rule's kernel in
  its own pass where it can (`kernels.rounded_step`: plain Adam, SGD with momentum,
  Adagrad and row-wise Adagrad without weight decay or `max_norm`; the row rounded
  while it is at hand), else by the generic kernel `row_round.add_rounded_rows` after
  the step, reading the table's rows in their 2 bytes a value.
  """
  param = inputs.tables.param
  assert param is not None  # the optax layer keeps it for the rounding
  compute_dtype = plan.config.compute_dtype
  rounds_rows = jnp.dtype(compute_dtype) == jnp.dtype(jnp.float32) and row_round.rounds_rows(
    param, nse=inputs.rows.shape[0], num_rows=plan.layout.num_rows
  )
  if rounds_rows and kernels.rounds_in_pass(inputs, plan):
    return kernels.rounded_step(inputs, plan)
  nearest = plan._replace(config=plan.config._replace(param_rounding="nearest"))
  result = kernels.masked_step(inputs, nearest)
  param_rows = bcoo.as_rows(param, plan.layout)
  if rounds_rows:
    keys = rounding.kernel_keys(inputs.step, rounding.PARAM_SLOT, inputs.row_offset)
    new_rows = row_round.add_rounded_rows(
      param_rows,
      result.rows,
      result.delta,
      keys,
      num_rows=plan.layout.num_rows,
      stochastic=True,  # this path serves param_rounding="stochastic" only
    )
    return result._replace(delta=new_rows)
  new_rows = xla.rounded_param_rows(
    inputs,
    plan,
    result.rows,
    bcoo.gather_rows(param_rows, result.rows).astype(compute_dtype),
    result.delta.astype(compute_dtype),
  )
  return result._replace(delta=new_rows)


def _kernel_store(layout: RowLayout) -> xla.RowStore:
  """The CPU's in-place row store (`kernels.store_rows`) for tables of `layout`'s rows."""

  def store(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    # The rows are distinct but for padding, which is out of range and dropped.
    return kernels.store_rows(table, rows, values, num_rows=layout.num_rows, rows_unique=True)

  return store


def scatter_add(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: RowLayout,
  rows_unique: bool,
  rows_sorted: bool,
) -> jax.Array:
  """`param[rows] += values` on the backend it is lowered for; padding rows dropped."""
  # The XLA scatter-add every path but the kernel's runs, with the path's own flags.
  xla_add = functools.partial(
    xla.scatter_add, layout=layout, rows_unique=rows_unique, rows_sorted=rows_sorted
  )
  generic = xla_add

  def on_cpu() -> Callable[..., jax.Array] | None:
    if row_round.rounds_rows(param, nse=rows.shape[0], num_rows=layout.num_rows):

      def add_rounded(param, rows, values):
        # bfloat16 and float16: XLA's sums and roundings, in place (no 16-bit table copy).
        return row_round.add_rows_in_place(
          param, rows, values, num_rows=layout.num_rows, rows_unique=rows_unique
        )

      return add_rounded
    if kernels.scatter_add_applies(param, values, layout=layout):

      def add(param, rows, values):
        # The kernel takes the parameter in its own shape: a reshaped operand that
        # it updates in place would be copied by XLA.
        return kernels.scatter_add_rows(
          param, rows, values, num_rows=layout.num_rows, rows_unique=rows_unique
        )

      return add
    return None

  # One scatter-add of the parameter's own dtype, no sort, on GPUs and TPUs.
  # An update from sparse_adam repeats no row (its padding rows are dropped),
  # but its flags mirror the gradient's, so they cannot promise that to XLA.
  on_accelerator = functools.partial(xla_add, through_bits=False)

  return _by_backend(
    (param, rows, values),
    cpu=_on_cpu(on_cpu, (param, rows, values), generic),
    accelerator=on_accelerator,
    generic=generic,
  )


def store_rows(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: RowLayout,
  rows_unique: bool,
  rows_sorted: bool,
) -> jax.Array:
  """`param[rows] = values` (a rule's set rows) on the backend it is lowered for; no padding."""

  def through(bits: bool) -> Callable[..., jax.Array]:
    def store(param, rows, values):
      return xla.store_rows(
        param,
        rows,
        values,
        layout=layout,
        rows_unique=rows_unique,
        rows_sorted=rows_sorted,
        through_bits=bits,
      )

    return store

  # XLA:CPU has no 16-bit float scatter: the bits are stored there and elsewhere.
  generic = through(True)

  def on_cpu() -> Callable[..., jax.Array] | None:
    if not kernels.store_applies(param, nse=rows.shape[0], num_rows=layout.num_rows):
      return None

    def store(param, rows, values):
      # The same bits, stored in place by the generic kernel (no 16-bit table copy).
      return kernels.store_rows(
        param, rows, values, num_rows=layout.num_rows, rows_unique=rows_unique
      )

    return store

  return _by_backend(
    (param, rows, values),
    cpu=_on_cpu(on_cpu, (param, rows, values), generic),
    accelerator=through(False),
    generic=generic,
  )


def _on_cpu(
  kernel: Callable[[], Callable[..., Any] | None], arrays: Any, generic: Callable[..., Any]
) -> Callable[..., Any]:
  """The CPU's path: `kernel()` (the kernels' path, or None where none applies), else `generic`.

  The kernels run only on arrays on one device. Where that is known now, they are
  chosen now; where the arrays' types do not say (jit in a process with several
  CPU devices), the kernels are traced as for one device and chosen when the
  program is lowered, if it is lowered for one device (`one_device`).
  """
  now = kernel()
  if now is not None:
    return now
  if not sharding.possibly_on_one_cpu_device(arrays):
    return generic
  with sharding.lowering_per_shard():
    later = kernel()
  if later is None:
    return generic

  def per_device(*args: Any) -> Any:
    with sharding.lowering_per_shard():
      return later(*args)

  return one_device.on_one_device(per_device, generic)


_ACCELERATOR_PLATFORMS = ("cuda", "rocm", "tpu")


def _by_backend(
  args: tuple,
  *,
  cpu: Callable[..., Any],
  accelerator: Callable[..., Any],
  generic: Callable[..., Any],
) -> Any:
  """`cpu(*args)` on the CPU, `accelerator(*args)` on CUDA/ROCm/TPU, `generic(*args)` elsewhere.

  Chosen when the step is lowered (one branch per backend it is lowered for);
  a forced path (`choice.PathChoice.forced`) runs on every backend instead.
  """
  forced = choice.forced()
  if forced == choice.ACCELERATOR:
    return accelerator(*args)
  if forced == choice.GENERIC_XLA:
    return generic(*args)
  branches = dict.fromkeys(_ACCELERATOR_PLATFORMS, accelerator)

  def by_platform(*args):
    return lax.platform_dependent(*args, cpu=cpu, default=generic, **branches)

  if cpu is generic:
    return by_platform(*args)
  return _differentiated_as(by_platform, generic)(*args)


def _differentiated_as(run: Callable[..., Any], generic: Callable[..., Any]) -> Callable[..., Any]:
  """`run`, whose derivatives are those of `generic` (XLA ops), for `jax.jvp`, `grad`, `vmap`.

  The CPU kernels are FFI calls, which JAX cannot differentiate; they compute
  what `generic` computes bit for bit (catch-up: to float32 rounding), so a step
  that is differentiated (through the optimizer, e.g. to tune a learning rate)
  runs `generic` and its JVP.
  """
  wrapped = jax.custom_jvp(run)

  @wrapped.defjvp
  def jvp(primals, tangents):
    return jax.jvp(generic, primals, tangents)

  return wrapped
