"""The fused CPU kernel's catch-up of idle rows and decoupled weight decay equal the XLA ops.

Catch-up (`catch_up_idle_rows=True`) runs in the Adam kernel as in
`xla.masked_step`, operation for operation, except that the per-row powers and
geometric sums use the C library's `exp`/`expm1`, which may differ from XLA's
in the last bit: the two paths agree to float32 rounding (a few ulps), not bit
for bit; rows idle 0 steps (no transcendental differs) and the last-step table
agree exactly (AdamW's `delta - lr * wd * p` rounds its product on both paths).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from optax_sparse_adam._backends.cpu import kernels
from tests._helpers import cpu_only, padded_grad, tiered, train_step

pytestmark = [
  cpu_only("the fused CPU kernels run, and equal the XLA ops,"),
  pytest.mark.skipif(not kernels.available(), reason="the CPU kernels were not built"),
]

CATCH_UP_KERNEL = "optax_sparse_adam_fused_adam_options_f32"
VOCAB, DIM = 40, 12
# Ids per gradient at most (`_pattern`'s 12 and a duplicate), padded to one shape: one
# compile per run.
NSE = 13


def _pattern(steps: int) -> list[list[int]]:
  """Rows touched per step: every step, every 2nd, 3rd, 4th, once early, twice, never, by chance."""
  rng = np.random.default_rng(7)
  pattern = []
  for t in range(1, steps + 1):
    rows = [0] + [1] * (t % 2 == 1) + [2] * (t % 3 == 1) + [3] * (t % 4 == 1)
    rows += [4] if t in (1, steps) else []
    rows += [5] if t in (2, steps - 1) else []
    rows += rng.choice(np.arange(10, VOCAB), 6, replace=False).tolist()
    pattern.append(rows)
  return pattern


def _run(opt, pattern, *, kernels_on: bool, jit: bool = True, seed: int = 0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=(VOCAB, DIM)), jnp.float32)}
  state = opt.init(params)
  step = train_step(opt)
  step = jax.jit(step, donate_argnums=(0, 1)) if jit else step
  path = {} if kernels_on else {"forced": choice.GENERIC_XLA}
  values_rng = np.random.default_rng(seed + 1)
  with choice.choose(**path):
    for rows in pattern:
      ids = np.array(rows + rows[:1], np.int32)  # a duplicate id: the step sums it
      values = values_rng.normal(size=(len(ids), DIM)).astype(np.float32)
      grads = {"w": padded_grad(ids, values, (VOCAB, DIM), max(NSE, len(ids)))}
      params, state = step(params, state, grads)
  return jax.device_get((params, state))


def _ulps_of_largest(got, want) -> float:
  """The largest difference, in float32 ulps of the array's largest magnitude."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = np.spacing(np.abs(want).max())
  return float(np.abs(got.astype(np.float64) - want).max() / scale)


OPTIONS = {
  "adam": lambda: osa.sparse_adam(0.05, catch_up_idle_rows=True),
  "adam_large_eps": lambda: osa.sparse_adam(0.05, b2=0.99, eps=0.3, catch_up_idle_rows=True),
  "adamw": lambda: osa.sparse_adamw(0.05, weight_decay=0.5, catch_up_idle_rows=True),
  "maximize": lambda: osa.sparse_adam(0.05, maximize=True, catch_up_idle_rows=True),
  "eps0": lambda: osa.sparse_adam(0.05, eps=1e-30, catch_up_idle_rows=True),
  "schedule": lambda: osa.sparse_adamw(
    lambda count: 0.05 / (1.0 + count), weight_decay=0.1, catch_up_idle_rows=True
  ),
  "bf16": lambda: osa.sparse_adam(
    0.05, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, catch_up_idle_rows=True
  ),
  "bf16_stochastic": lambda: osa.sparse_adamw(
    0.05, mu_dtype=jnp.bfloat16, moment_rounding="stochastic", catch_up_idle_rows=True
  ),
}

# Float32 rounding: the per-row factors differ by an ulp or so, and the
# parameters drift apart by a few ulps (of the table's largest value) over the
# steps; a bf16 moment may round to a neighbour (2^16 float32 ulps) when that
# difference straddles a rounding boundary.
MAX_ULPS = {"bf16": 2.0**16, "bf16_stochastic": 2.0**16}


# amsgrad with AdamW (amsgrad's denominator over the window is the running max's), jitted.
OPTIONS["adamw_amsgrad"] = lambda: osa.sparse_adamw(
  0.05, weight_decay=0.5, amsgrad=True, catch_up_idle_rows=True
)
# Eagerly (slow: op by op) for the options whose arithmetic differs most: AdamW's decay,
# a schedule, stochastic rounding; the rest jitted only.
EAGER = ("adamw", "schedule", "bf16_stochastic")
CASES = [(name, True) for name in OPTIONS] + [(name, False) for name in EAGER]


@pytest.mark.parametrize(
  "name,jit",
  tiered(
    CASES,
    lambda case: (
      # Eager cells (op by op: a minute each here) run in the slow tier; the default
      # tier's eager steps are test_sparse_adam's and test_cpu_kernels'.
      case[0] not in ("adam", "adamw", "bf16_stochastic", "eps0") or not case[1]
    ),
  ),
  ids=[f"{name}-{'jit' if jit else 'eager'}" for name, jit in CASES],
)
def test_catch_up_kernel_equals_xla_ops_to_float32_rounding(name, jit):
  steps = 23 if jit else 9
  pattern = _pattern(steps)
  with_kernel = _run(OPTIONS[name](), pattern, kernels_on=True, jit=jit)
  with_xla = _run(OPTIONS[name](), pattern, kernels_on=False, jit=jit)
  (p_k, s_k), (p_x, s_x) = with_kernel, with_xla
  np.testing.assert_array_equal(s_k.row_last_step["w"], s_x.row_last_step["w"])
  last = np.asarray(s_k.row_last_step["w"])
  assert last[0] == last[4] == steps and last[5] == steps - 1 and not last[6:10].any()
  for got, want in ((p_k["w"], p_x["w"]), (s_k.mu["w"], s_x.mu["w"]), (s_k.nu["w"], s_x.nu["w"])):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7 * np.abs(want).max())
    assert _ulps_of_largest(got, want) <= MAX_ULPS.get(name, 4.0)


def test_rows_updated_every_step_agree_bit_for_bit():
  """Rows never idle take no exp or expm1 of the C library: the paths agree exactly there."""
  pattern = [[0, 1, 2, *range(10, 20)] for _ in range(9)]
  (p_k, s_k), (p_x, s_x) = (
    _run(OPTIONS["adamw"](), pattern, kernels_on=on) for on in (True, False)
  )
  for got, want in ((p_k["w"], p_x["w"]), (s_k.mu["w"], s_x.mu["w"]), (s_k.nu["w"], s_x.nu["w"])):
    rows = [0, 1, 2, *range(10, 20)]
    np.testing.assert_array_equal(
      np.asarray(got)[rows].view(np.uint32), np.asarray(want)[rows].view(np.uint32)
    )


def test_rows_idle_0_steps_with_an_infinite_value_are_caught_up_as_the_xla_ops_do():
  """The kernel skips catch-up's terms on rows idle 0 steps only where all their values are
  finite: with AdamW an infinite parameter makes the window's (zero) decay `0 * inf` NaN, as
  in the XLA ops (skipped, the update would be -inf)."""
  opt = OPTIONS["adamw"]()
  params = {"w": jnp.ones((VOCAB, DIM)).at[0, 0].set(jnp.inf)}
  ids = jnp.array([[0], [1]])
  grads = {"w": sparse.BCOO((jnp.ones((2, DIM)), ids), shape=(VOCAB, DIM))}
  updates = []
  for path in ({}, {"forced": choice.GENERIC_XLA}):
    with choice.choose(**path):
      update = jax.jit(opt.update)
      _, state = update(grads, opt.init(params), params)  # rows 0 and 1 then idle 0 steps
      delta = update(grads, state, params)[0]["w"]
      updates.append(np.asarray(delta.todense() if isinstance(delta, sparse.BCOO) else delta))
  assert np.isnan(updates[1][0, 0])
  np.testing.assert_array_equal(updates[0][:2], updates[1][:2])


def test_the_paths_differ_where_idle_rows_are_caught_up():
  """The comparison above can fail: catch-up moves idle rows (lazy Adam leaves them)."""
  pattern = _pattern(11)
  caught, _ = _run(OPTIONS["adam"](), pattern, kernels_on=True)
  lazy, _ = _run(osa.sparse_adam(0.05), pattern, kernels_on=True)
  assert np.abs(np.asarray(caught["w"]) - np.asarray(lazy["w"]))[1:4].max() > 1e-4


def _compiled_text(opt) -> str:
  params = {"w": jnp.zeros((VOCAB, DIM))}
  grads = {"w": sparse.BCOO((jnp.ones((2, DIM)), jnp.array([[1], [3]])), shape=(VOCAB, DIM))}
  step = jax.jit(train_step(opt), donate_argnums=(0, 1))
  return step.lower(params, opt.init(params), grads).compile().as_text()


def test_the_kernel_runs_catch_up_with_adamw_and_amsgrad():
  for opt in (
    osa.sparse_adam(catch_up_idle_rows=True),
    osa.sparse_adamw(catch_up_idle_rows=True),
    osa.sparse_adam(amsgrad=True, catch_up_idle_rows=True),
    osa.sparse_adamw(amsgrad=True, catch_up_idle_rows=True),
  ):
    text = _compiled_text(opt)
    assert CATCH_UP_KERNEL in text and "catch_up = true" in text
  # Lazy steps with options run the same kernel without catch-up; the default its own.
  for opt in (osa.sparse_adam(weight_decay=0.1), osa.sparse_adamw()):
    text = _compiled_text(opt)
    assert CATCH_UP_KERNEL in text and "catch_up = false" in text
  assert CATCH_UP_KERNEL not in _compiled_text(osa.sparse_adam())
  with kernels.use_cpu_kernels(False):
    assert CATCH_UP_KERNEL not in _compiled_text(osa.sparse_adam(catch_up_idle_rows=True))


def test_catch_up_kernel_updates_tables_in_place():
  """Donated, the step's tables (moments, last steps) are updated in place: no table copies."""
  opt = osa.sparse_adamw(catch_up_idle_rows=True)
  text = _compiled_text(opt)
  shape = f"f32[{VOCAB},{DIM}]"
  copies = [line for line in text.splitlines() if " copy(" in line and shape in line]
  assert not copies, copies
