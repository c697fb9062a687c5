"""A 16-bit table's step against the float32 table's, on one device and routed, in one run.

One jitted, donated step of a rule (`--rule`: `sparse_adam` by default, float32
moments; SGD with lazy momentum, Adagrad, row-wise Adagrad, Adam with amsgrad, row-wise
Adam; every slot in float32, so that only the table's dtype differs) with
`update` + `apply_updates`, of a V x D table from B ids (Zipf or uniform), for each of:

- the float32 table, float32 gradient (the reference);
- bfloat16 and float16 tables rounded stochastically (`param_rounding="stochastic"`),
  the gradient in the table's dtype or in float32;
- a bfloat16 table rounded to nearest, bfloat16 or float32 gradient.

Each is timed in interleaved rounds (one run of `--steps` steps of each case in
turn, cycling 8 batches), so load from other processes hits all alike; printed is
the median (range) over rounds of the per-round ratio to the float32 table's step,
with the CPU kernels each compiled step calls. The same cases run routed (the table
split by rows over 4 forced CPU devices, `osa.sharded_routing`, rows in blocks) in
a subprocess, as `bench_routed_tables` does, unless `--one-device`.

  python -m benchmarks.bench_16bit_step                  # V = 1M, D = 64, B = 4096, Zipf
  python -m benchmarks.bench_16bit_step --dist uniform --one-device
  python -m benchmarks.bench_16bit_step --two-pass      # also the former two-pass rounding
  python -m benchmarks.bench_16bit_step --rule rowwise_adagrad --two-pass --one-device
"""

import os
import sys

_ROUTED = "--routed-child" in sys.argv
if _ROUTED and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from benchmarks import _common as c  # noqa: E402
from optax_sparse_adam._backends.cpu import kernels, moment_steps  # noqa: E402

# (label, table dtype, gradient dtype, param_rounding); the first is the reference.
CASES = [
  ("f32 table, f32 gradient", jnp.float32, jnp.float32, "nearest"),
  ("bf16 table, bf16 gradient, stochastic", jnp.bfloat16, jnp.bfloat16, "stochastic"),
  ("bf16 table, f32 gradient, stochastic", jnp.bfloat16, jnp.float32, "stochastic"),
  ("f16 table, f16 gradient, stochastic", jnp.float16, jnp.float16, "stochastic"),
  ("f16 table, f32 gradient, stochastic", jnp.float16, jnp.float32, "stochastic"),
  ("bf16 table, bf16 gradient, nearest", jnp.bfloat16, jnp.bfloat16, "nearest"),
  ("bf16 table, f32 gradient, nearest", jnp.bfloat16, jnp.float32, "nearest"),
]
# With `--two-pass`: the 16-bit cases as they ran before the Adam kernel wrote 16-bit rows
# in its own pass (its float32 delta, then `row_round.add_rounded_rows` or XLA's convert to
# the gradient's dtype), for reference.
TWO_PASS = [
  (f"{label} (two passes)", *rest)
  for label, *rest in CASES
  if rest[2] == "stochastic" or jnp.dtype(rest[1]) != jnp.dtype(jnp.float32)
]


# `--rule`: the optimizer, given its param_rounding; slots in float32 (`_float32_slots`).
RULES = {
  "adam": lambda r: osa.sparse_adam(1e-3, mu_dtype="float32", nu_dtype="float32", param_rounding=r),
  "adam_amsgrad": lambda r: osa.sparse_adam(
    1e-3, amsgrad=True, mu_dtype="float32", nu_dtype="float32", param_rounding=r
  ),
  "rowwise_adam": lambda r: osa.sparse_adam(
    1e-3, rowwise_second_moment=True, mu_dtype="float32", nu_dtype="float32", param_rounding=r
  ),
  "sgd_momentum": lambda r: osa.sparse_sgd(
    1e-3, momentum=0.9, lazy_momentum=True, param_rounding=r
  ),
  "adagrad": lambda r: osa.sparse_adagrad(1e-2, param_rounding=r),
  "rowwise_adagrad": lambda r: osa.sparse_rowwise_adagrad(1e-2, param_rounding=r),
}


def _float32_slots(state):
  """The state with its 16-bit slots in float32: SGD's and Adagrad's slots follow the
  table's dtype, and the fused kernels store no float16 slot."""
  sixteen = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype in sixteen else x, state)


@contextlib.contextmanager
def _two_passes(on: bool):
  """Within the block, steps traced round a 16-bit table's rows (or convert a 16-bit
  gradient's delta) after the kernel's pass."""
  if not on:
    yield
    return
  saved = kernels.rounds_in_pass, moment_steps.narrows_in_pass
  kernels.rounds_in_pass = moment_steps.narrows_in_pass = lambda inputs, plan: False
  try:
    yield
  finally:
    kernels.rounds_in_pass, moment_steps.narrows_in_pass = saved


def _stepper(rule, dtype, grad_dtype, rounding, batches, *, num_rows, dim, mesh, two_pass=False):
  """`(run(n) -> seconds per step, the kernels the compiled step calls)`; routed over
  `mesh` where given, else on one device."""
  opt = RULES[rule](rounding)

  def step(table, state, ids, rows):
    grad = sparse.BCOO((rows, ids[:, None]), shape=table.shape)
    updates, state = opt.update({"t": grad}, state, {"t": table})
    return osa.apply_updates({"t": table}, updates)["t"], state

  def put(x, spec):
    return jnp.asarray(x) if mesh is None else jax.device_put(x, NamedSharding(mesh, spec))

  def routing():
    return osa.sharded_routing(True) if mesh is not None else contextlib.nullcontext()

  with routing(), _two_passes(two_pass):
    jitted = jax.jit(step, donate_argnums=(0, 1))
    table = put(jnp.zeros((num_rows, dim), dtype), P("x", None))
    state = _float32_slots(opt.init({"t": table}))
    # The gradient's rows come in its dtype (a model's), not converted in the step.
    data = [(put(i, P("x")), put(r.astype(grad_dtype), P("x", None))) for i, r in batches]
    hlo = jitted.lower(table, state, *data[0]).compile().as_text()
  box = {"table": table, "state": state}

  def run(n: int) -> float:
    with routing():  # the switch is part of the cache key
      start = time.perf_counter()
      for k in range(n):
        box["table"], box["state"] = jitted(box["table"], box["state"], *data[k % len(data)])
      jax.block_until_ready(box["table"])
      return (time.perf_counter() - start) / n

  with _two_passes(two_pass):
    run(3)  # warm up (traced, if it were traced again, as compiled above)
  return run, sorted(set(re.findall(r"optax_sparse_adam_\w+", hlo)))


def time_cases(args, *, routed: bool) -> None:
  """Times `CASES` in interleaved rounds and prints their ratios to the first."""
  mesh = None
  where = "one device"
  if routed:
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("x",), axis_types=(AxisType.Auto,))
    where = f"routed over {len(devices)} forced CPU devices"
  ids = c.id_batches(args.dist, args.vocab, args.batch)
  values = c.grad_values(args.batch, args.dim)
  batches = [
    (np.asarray(i, np.int32), np.asarray(v, np.float32)) for i, v in zip(ids, values, strict=True)
  ]
  runs = {}
  # The other rules convert a 16-bit gradient's delta after their kernel either way.
  two_pass = [x for x in TWO_PASS if args.rule == "adam" or x[3] == "stochastic"]
  cases = [(case, False) for case in CASES] + [(case, True) for case in two_pass * args.two_pass]
  for (label, dtype, grad_dtype, rounding), two_pass in cases:
    runs[label], called = _stepper(
      args.rule,
      dtype,
      grad_dtype,
      rounding,
      batches,
      num_rows=args.vocab,
      dim=args.dim,
      mesh=mesh,
      two_pass=two_pass,
    )
    print(f"  {label}: calls {', '.join(k[len('optax_sparse_adam_') :] for k in called) or '-'}")
  times: dict[str, list[float]] = {label: [] for label in runs}
  for _ in range(args.rounds):
    for label, run in runs.items():
      times[label].append(run(args.steps))
  base = times[CASES[0][0]]
  print(
    f"{c.machine()}; {args.rule}, {where}, V={args.vocab:,} D={args.dim} B={args.batch} "
    f"({args.dist} ids); "
    f"median (range) of {args.rounds} interleaved rounds of {args.steps} steps"
  )
  for label, seconds in times.items():
    ratios = [t / b for t, b in zip(seconds, base, strict=True)]
    print(
      f"  {label:40s} {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
      f" x the f32 table's step; fastest {min(seconds) * 1e3:.3f} ms"
    )
  sys.stdout.flush()


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)  # --vocab, --dim, --batch
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
  parser.add_argument("--dist", default="zipf", choices=("zipf", "uniform"), help="ids")
  parser.add_argument("--one-device", action="store_true", help="skip the routed run")
  parser.add_argument("--rule", default="adam", choices=sorted(RULES), help="the optimizer")
  parser.add_argument(
    "--two-pass", action="store_true", help="also the stochastic cases' former two-pass path"
  )
  parser.add_argument("--routed-child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.routed_child:
    time_cases(args, routed=True)
    return
  print(f"jax {jax.__version__}, CPU kernels available: {osa.cpu_kernels_available()}")
  time_cases(args, routed=False)
  if not args.one_device:
    # A fresh process: the forced devices must be set before JAX starts.
    argv = sys.argv[1:] if argv is None else list(argv)
    subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_16bit_step", *argv, "--routed-child"], check=True
    )


if __name__ == "__main__":
  main()
