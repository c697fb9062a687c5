"""Shared pieces of the benchmarks: id streams, timed steps, the memory floor.

Every timing is the best of `repeats` runs of `steps` back-to-back steps (the
mean step of the fastest run): on a shared machine the fastest run is the one
least disturbed by other processes. Ratios are taken between timings made in
the same process, one after the other.
"""

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from benchmarks._timing import best_seconds, ratio  # noqa: E402, F401 (ratio: for the benchmarks)
from optax_sparse_adam._backends.cpu import huge_pages as huge_page_advice  # noqa: E402
from optax_sparse_adam._backends.cpu import kernels  # noqa: E402
from optax_sparse_adam._core import bcoo, coalesce  # noqa: E402

try:
  import torch
except ImportError:  # torch is optional: its rows are skipped.
  torch = None

ZIPF_EXPONENT = 1.2
NUM_BATCHES = 8  # Distinct gradients cycled through, so no step sees a warm repeat.

_zipf_cdf_cache: dict[tuple[int, float], tuple[np.ndarray, np.ndarray]] = {}


def zipf_ids(rng: np.random.Generator, num_rows: int, size: int, s: float = ZIPF_EXPONENT):
  """`size` ids in `[0, num_rows)`, rank k drawn with probability ~ k**-s.

  Ranks are mapped to ids by a fixed random permutation, so popular rows are
  spread over the table as in a real vocabulary, not packed at its start.
  """
  key = (num_rows, s)
  if key not in _zipf_cdf_cache:
    cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    perm = np.random.default_rng(12345).permutation(num_rows).astype(np.int32)
    _zipf_cdf_cache[key] = (cdf, perm)
  cdf, perm = _zipf_cdf_cache[key]
  ranks = np.minimum(np.searchsorted(cdf, rng.random(size)), num_rows - 1)
  return perm[ranks]


def uniform_ids(rng: np.random.Generator, num_rows: int, size: int):
  return rng.integers(0, num_rows, size, dtype=np.int32)


def id_batches(
  dist: str, num_rows: int, batch: int, seed: int = 0, count: int = NUM_BATCHES
) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  draw = zipf_ids if dist == "zipf" else uniform_ids
  return [draw(rng, num_rows, batch) for _ in range(count)]


def grad_values(batch: int, dim: int, seed: int = 1) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((batch, dim), dtype=np.float32) for _ in range(NUM_BATCHES)]


def best_step_time(run_steps: Callable[[int], None], steps: int, repeats: int) -> float:
  """Seconds per step: the fastest of `repeats` runs of `steps` steps."""
  run_steps(2)  # warm-up, compilation included
  return best_seconds(lambda: run_steps(steps), repeats, warm_up=False) / steps


def _coalesce_by_permutation_sort(rows, values, num_rows):
  """The first core's coalescing, kept as a baseline: a stable sort carrying the permutation."""
  nse = rows.shape[0]
  slots = jnp.arange(nse, dtype=jnp.int32)
  sorted_rows, order = jax.lax.sort((rows, slots), num_keys=1, is_stable=True)
  is_first = jnp.concatenate([jnp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]])
  segment_of_sorted = jnp.cumsum(is_first, dtype=jnp.int32) - 1
  segment = jnp.zeros((nse,), jnp.int32).at[order].set(segment_of_sorted, unique_indices=True)
  summed = jnp.zeros_like(values).at[segment].add(values, mode="promise_in_bounds")
  unique_rows = (
    jnp.full((nse,), num_rows, jnp.int32)
    .at[jnp.where(is_first, segment_of_sorted, nse)]
    .set(sorted_rows, mode="drop", unique_indices=True)
  )
  valid = unique_rows < num_rows
  unique_rows = jnp.where(valid, unique_rows, num_rows + slots)
  summed = jnp.where(valid.reshape((nse,) + (1,) * (values.ndim - 1)), summed, 0)
  return bcoo.CoalescedRows(unique_rows, summed)


@contextlib.contextmanager
def permutation_sort_baseline() -> Iterator[None]:
  """Inside this block sparse_adam runs XLA ops and coalesces as the first core did."""
  fast = coalesce.coalesce_and_gather_rows

  def baseline(rows, values, num_rows, tables):
    coalesced = _coalesce_by_permutation_sort(rows, values, num_rows)
    gathered = [None if t is None else bcoo.gather_rows(t, coalesced.rows) for t in tables]
    return coalesced, gathered, list(tables)

  coalesce.coalesce_and_gather_rows = baseline
  try:
    with kernels.use_cpu_kernels(False):  # the baseline is a path of XLA ops
      yield
  finally:
    coalesce.coalesce_and_gather_rows = fast


def sparse_step(opt: optax.GradientTransformation) -> Callable:
  """`opt.update` + `osa.apply_updates`: the step every sparse benchmark times."""

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  return step


def time_jitted_steps(
  step: Callable,
  params: Any,
  state: Any,
  grads: list[Any],
  *,
  donate: bool,
  steps: int,
  repeats: int,
) -> float:
  """Seconds per call of `jax.jit(step)` cycling through `grads`, the best of `repeats` runs."""
  jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  carry = [params, state]

  def run(n):
    p, s = carry
    for k in range(n):
      p, s = jitted(p, s, grads[k % len(grads)])
    jax.block_until_ready((p, s))
    carry[:] = [p, s]

  return best_step_time(run, steps, repeats)


def time_sparse_adam(
  ids: list[np.ndarray],
  values: list[np.ndarray],
  num_rows: int,
  *,
  donate: bool = True,
  cpu_kernels: bool | None = None,
  huge_pages: bool = False,
  steps: int = 20,
  repeats: int = 5,
  **opt_kwargs: Any,
) -> float:
  """sparse_adam.update + apply_updates in one jitted step, params and state donated.

  `cpu_kernels=False` times the XLA-ops path (what GPUs and TPUs run) on the CPU;
  None keeps the current setting. `huge_pages` advises the tables onto
  transparent huge pages first (`osa.advise_huge_pages`).
  """
  dim = values[0].shape[1]
  opt = osa.sparse_adam(1e-3, **opt_kwargs)
  params = {"table": jnp.zeros((num_rows, dim), jnp.float32)}
  state = opt.init(params)
  if huge_pages:
    osa.advise_huge_pages((params, state))
  grads = [
    {"table": sparse.BCOO((jnp.asarray(v), jnp.asarray(i[:, None])), shape=(num_rows, dim))}
    for i, v in zip(ids, values, strict=True)
  ]

  if cpu_kernels is None:
    setting = contextlib.nullcontext()
  else:
    setting = kernels.use_cpu_kernels(cpu_kernels)
  with setting:
    return time_jitted_steps(
      sparse_step(opt), params, state, grads, donate=donate, steps=steps, repeats=repeats
    )


def time_multi_table(
  tables: dict[str, tuple[list[np.ndarray], list[np.ndarray], int]],
  *,
  fused: bool,
  steps: int = 10,
  repeats: int = 3,
) -> float:
  """One step over many embedding tables: one jitted call for all, or one call per table.

  `tables` maps a name to `(ids, values, num_rows)`. Returns seconds per step
  (for `fused=False`, the sum over the tables' separate jitted steps).
  """
  opt = osa.sparse_adam(1e-3)
  jitted = jax.jit(sparse_step(opt), donate_argnums=(0, 1))
  groups = [list(tables)] if fused else [[name] for name in tables]
  carries, batches = [], []
  for names in groups:
    params = {n: jnp.zeros((tables[n][2], tables[n][1][0].shape[1]), jnp.float32) for n in names}
    carries.append([params, opt.init(params)])
    batches.append(
      [
        {
          n: sparse.BCOO(
            (jnp.asarray(tables[n][1][k]), jnp.asarray(tables[n][0][k][:, None])),
            shape=params[n].shape,
          )
          for n in names
        }
        for k in range(NUM_BATCHES)
      ]
    )

  def run(n):
    for carry, grads in zip(carries, batches, strict=True):
      p, s = carry
      for k in range(n):
        p, s = jitted(p, s, grads[k % len(grads)])
      carry[:] = [p, s]
    jax.block_until_ready(carries)

  seconds = best_step_time(run, steps, repeats)
  return seconds


def time_optax_adam_dense(
  ids: list[np.ndarray],
  values: list[np.ndarray],
  num_rows: int,
  *,
  steps: int = 5,
  repeats: int = 3,
) -> float:
  """optax.adam + optax.apply_updates on the equivalent dense gradient, donated.

  The dense gradients are built before timing: only the optimizer step is timed.
  """
  dim = values[0].shape[1]
  opt = optax.adam(1e-3)
  params = jnp.zeros((num_rows, dim), jnp.float32)
  state = opt.init(params)
  # Two dense gradients are enough to cycle through; each is num_rows x dim.
  grads = [
    jnp.zeros((num_rows, dim), jnp.float32).at[jnp.asarray(i)].add(jnp.asarray(v))
    for i, v in zip(ids[:2], values[:2], strict=True)
  ]

  def step(params, state, grad):
    updates, state = opt.update(grad, state, params)
    return optax.apply_updates(params, updates), state

  return time_jitted_steps(step, params, state, grads, donate=True, steps=steps, repeats=repeats)


def time_torch_sparse_adam(
  ids: list[np.ndarray],
  values: list[np.ndarray],
  num_rows: int,
  *,
  huge_pages: bool = False,
  steps: int = 20,
  repeats: int = 5,
) -> float | None:
  """torch.optim.SparseAdam.step on uncoalesced sparse gradients (it coalesces them itself).

  Timed with torch's default thread count and with one thread; the faster
  counts (on a busy machine OpenMP's barriers make the multi-threaded run slow).
  """
  if torch is None:
    return None
  default_threads = torch.get_num_threads()
  try:
    timings = []
    for threads in sorted({default_threads, 1}):
      torch.set_num_threads(threads)
      timings.append(
        _time_torch(ids, values, num_rows, huge_pages=huge_pages, steps=steps, repeats=repeats)
      )
    return min(timings)
  finally:
    torch.set_num_threads(default_threads)


def torch_sparse_steps(param, opt, ids, values):
  """`run(n)`: `n` steps of a torch optimizer over `param`, cycling the batches' sparse grads."""
  num_rows, dim = param.shape
  grads = [
    torch.sparse_coo_tensor(
      torch.from_numpy(i.astype(np.int64))[None],
      torch.from_numpy(v),
      (num_rows, dim),
      check_invariants=False,
    )
    for i, v in zip(ids, values, strict=True)
  ]

  def run(n):
    for k in range(n):
      param.grad = grads[k % len(grads)]
      opt.step()

  return run


def _time_torch(ids, values, num_rows, *, huge_pages, steps, repeats):
  dim = values[0].shape[1]
  param = torch.nn.Parameter(torch.zeros(num_rows, dim))
  opt = torch.optim.SparseAdam([param], lr=1e-3)
  run = torch_sparse_steps(param, opt, ids, values)

  if huge_pages:  # the same advice for torch's table and moments (made by one step)
    with torch.no_grad():
      run(1)
    state = opt.state[param]
    tensors = [param.data, state["exp_avg"], state["exp_avg_sq"]]
    huge_page_advice.advise_memory([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])
  with torch.no_grad():
    seconds = best_step_time(run, steps, repeats)
  return seconds


def touched_rows(ids: list[np.ndarray]) -> float:
  """Mean number of distinct rows per batch."""
  return float(np.mean([np.unique(i).size for i in ids]))


def memory_floor(ids: list[np.ndarray], dim: int, *, repeats: int = 20) -> float:
  """Seconds to copy the bytes a masked step must touch, as one contiguous copy.

  A masked step reads and writes the touched rows of the parameter, m and v:
  `3 * rows * dim` float32 values read and written. Copying that many values
  contiguously is a lower bound no row-scattered step can beat.
  """
  n = 3 * int(round(touched_rows(ids))) * dim
  src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(10):
      np.copyto(dst, src)
    best = min(best, (time.perf_counter() - start) / 10)
  return best


def cpu_kernels_used() -> bool:
  return kernels.enabled()


def machine() -> str:
  threads = f", torch threads {torch.get_num_threads()} or 1" if torch is not None else ""
  return (
    f"{os.cpu_count()} CPUs, jax {jax.__version__} ({jax.default_backend()}), "
    f"optax {optax.__version__}" + (f", torch {torch.__version__}{threads}" if torch else "")
  )


def ms(seconds: float | None) -> str:
  return "—" if seconds is None else f"{seconds * 1e3:.3f} ms"


def table_parser(doc: str) -> argparse.ArgumentParser:
  """A script's parser (described by its docstring's first paragraph) with the table's
  sizes at the headline setting: `--vocab` rows, `--dim` width, `--batch` ids a step."""
  parser = argparse.ArgumentParser(
    description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--vocab", type=int, default=1_000_000, help="rows V of the table")
  parser.add_argument("--dim", type=int, default=64, help="row width D")
  parser.add_argument("--batch", type=int, default=4096, help="ids B a step (gradient)")
  return parser
