"""bf16 moments rounded stochastically (`moment_rounding="stochastic"`): unbiased, reproducible.

The random bits are checked against a NumPy implementation of the hash written
from the documented formula (`_core/rounding.py`'s docstring), and the
rounding's unbiasedness by a binomial test. Every path (the fused CPU kernels,
the XLA ops, the accelerator step forced onto the CPU) stores the same bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._core import rounding
from tests._helpers import STEP_PATHS, fmix32, on_path, tiered, train_step

PATHS = STEP_PATHS


def _numpy_hash32(step, pair, rows, row_size):
  """The documented hash `h`: 32 bits for each element of each row, in NumPy."""
  with np.errstate(over="ignore"):
    a = fmix32(np.uint32((step * 0x9E3779B9 + (pair + 1) * 0x27D4EB2F) & 0xFFFFFFFF))
    b = fmix32(a ^ (np.asarray(rows, np.uint32) * np.uint32(0x85EBCA77)))
    j = np.arange(row_size, dtype=np.uint32) * np.uint32(0xC2B2AE3D)
    return fmix32(b[:, None] ^ j[None, :])


def _numpy_random16(step, slot, rows, row_size):
  """The documented bits of a pair's first slot (or a one-slot rule's): `h >> 16`."""
  return _numpy_hash32(step, slot, rows, row_size) >> np.uint32(16)


def _numpy_stochastic_bf16(x, random16):
  """float32 -> bf16 bits: add the random bits below the kept 16, truncate."""
  word = np.asarray(x, np.float32).view(np.uint32)
  return ((word + random16.astype(np.uint32)) >> np.uint32(16)).astype(np.uint16)


def _grad(rows, dim, value, num_rows):
  data = jnp.full((len(rows), dim), value, jnp.float32)
  return sparse.BCOO((data, jnp.asarray(rows, jnp.int32)[:, None]), shape=(num_rows, dim))


@pytest.mark.parametrize(
  ("jit", "path"),
  tiered(
    [(jit, path) for jit in (True, False) for path in PATHS],
    lambda case: not case[0] and case[1] != "default",
  ),
  ids=[f"{'jit' if jit else 'eager'}-{path}" for jit in (True, False) for path in PATHS],
)
def test_first_step_bits_follow_the_documented_hash(path, jit):
  """mu after one step is `0.1 * g` rounded with the documented bits, on every path."""
  num_rows, dim = 40, 24
  rng = np.random.default_rng(0)
  rows = np.array([3, 17, 5, 39, 0])
  g = rng.standard_normal((len(rows), dim)).astype(np.float32)
  grad = sparse.BCOO((jnp.asarray(g), jnp.asarray(rows, jnp.int32)[:, None]), shape=(40, dim))
  opt = osa.sparse_adam(
    1e-2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic"
  )
  params = {"t": jnp.zeros((num_rows, dim))}
  update = jax.jit(opt.update) if jit else opt.update
  with on_path(path):
    _, state = update({"t": grad}, opt.init(params), params)
  mu_bits = np.asarray(state.mu["t"]).view(np.uint16)
  exact = g * np.float32(1 - 0.9)  # m = 0 + (g - 0) * (1 - b1), in float32
  expected = _numpy_stochastic_bf16(exact, _numpy_random16(1, 0, rows, dim))
  np.testing.assert_array_equal(mu_bits[rows], expected)
  untouched = np.setdiff1d(np.arange(num_rows), rows)
  np.testing.assert_array_equal(mu_bits[untouched], 0)


@pytest.mark.parametrize(
  "path, rowwise", [("default", False), ("xla_ops", False), ("default", True)]
)
def test_a_pair_shares_one_hash_nu_takes_its_low_half(path, rowwise):
  """mu rounds with `h >> 16` and nu with `h & 0xFFFF` of one element hash `h` (slot 0's).

  The unrounded float32 moments come from the same first step with float32
  moments (from zero moments, the stored float32 value is the one that bf16
  rounds); `h` is recomputed in NumPy from the documented formula. Row-wise
  Adam's nu (one value per row) takes element 0's hash.
  """
  num_rows, dim, step = 16, 8, 1
  rows = np.random.default_rng(2).permutation(num_rows)[:12]
  g = np.random.default_rng(1).standard_normal((len(rows), dim)).astype(np.float32)
  grad = sparse.BCOO((jnp.asarray(g), jnp.asarray(rows, jnp.int32)[:, None]), shape=(num_rows, dim))
  params = {"t": jnp.zeros((num_rows, dim))}

  def first_state(**kwargs):
    opt = osa.sparse_adam(1e-2, rowwise_second_moment=rowwise, **kwargs)
    with on_path(path):
      return jax.jit(opt.update)({"t": grad}, opt.init(params), params)[1]

  exact = first_state()
  stored = first_state(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic")
  h = _numpy_hash32(step, 0, rows, dim)
  for name, bits in (("mu", h >> np.uint32(16)), ("nu", h & np.uint32(0xFFFF))):
    want = np.asarray(getattr(exact, name)["t"])[rows]
    got = np.asarray(getattr(stored, name)["t"]).view(np.uint16)[rows]
    if want.ndim == 1:  # row-wise nu
      bits = bits[:, 0]
    np.testing.assert_array_equal(got, _numpy_stochastic_bf16(want, bits), err_msg=name)


# Values between two bf16 neighbours, at several fractions of the gap.
FRACTIONS = [1 / 65536, 0.01, 0.25, 0.5, 0.7, 0.99]


@pytest.mark.parametrize("low", [False, True], ids=["top_half", "low_half"])
def test_rounding_is_unbiased(low):
  """A binomial test per value: false alarms below 1e-6 in all, if the bits were random.

  Both halves of the hash are tested: a pair's first slot rounds with the top
  16 bits, its second with the low 16.

  For each of 6 values `x` strictly between bf16 neighbours `lo < hi`, 2^16
  roundings (rows x elements x steps of the hash) count how often `x` goes up;
  unbiased rounding makes that count Binomial(N, p) with `p = (x - lo) / (hi -
  lo)`. A count more than 5.5 standard deviations from `N p` fails: a two-sided
  tail of 3.8e-8 per value, so below 1e-6 for the 6 (Bonferroni). The hash is
  deterministic, so the test is too: it passes or fails the same way every run.
  Rounding to nearest would put every count at 0 or N.
  """
  lo = np.float32(1.203125)  # a bf16 value; its bf16 successor is lo + 2^-7
  hi = np.float32(lo + np.float32(2.0**-7))
  n_rows, row_size, steps = 256, 64, 4
  for fraction in FRACTIONS:
    x = np.float32(lo + np.float32(fraction) * (hi - lo))
    p = float((np.float64(x) - np.float64(lo)) / (np.float64(hi) - np.float64(lo)))
    ups = 0
    for step in range(1, steps + 1):
      bits = rounding.random_bits(
        rounding.step_key(jnp.int32(step), 0),
        jnp.arange(n_rows, dtype=jnp.int32),
        row_size,
        low=low,
      )
      out = rounding.stochastic_round_to_bf16(jnp.full((n_rows, row_size), x), bits)
      out = np.asarray(out, np.float32)
      assert set(np.unique(out)) <= {lo, hi}
      ups += int((out == hi).sum())
    n = n_rows * row_size * steps
    sigma = np.sqrt(n * p * (1 - p))
    assert abs(ups - n * p) <= 5.5 * sigma + 1, (fraction, ups, n * p, sigma)


@pytest.mark.parametrize("path", PATHS)
def test_stored_moments_are_unbiased_through_the_optimizer(path):
  """Over many rows, the mean of the stored bf16 `mu` is the exact float32 mean (5.5 sigma)."""
  num_rows, dim = 2048, 32
  value = 1.0 + 2.0**-9  # 0.1 * value lies between bf16 neighbours
  opt = osa.sparse_adam(
    1e-3, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic"
  )
  params = {"t": jnp.zeros((num_rows, dim))}
  grad = _grad(np.arange(num_rows), dim, value, num_rows)
  with on_path(path):
    _, state = jax.jit(opt.update)({"t": grad}, opt.init(params), params)
  mu = np.asarray(state.mu["t"], np.float64)
  exact = np.float64(np.float32(value) * np.float32(1 - 0.9))
  values = np.unique(mu)
  assert len(values) == 2, values  # rounded up or down, nothing else
  gap = values[1] - values[0]
  p = (exact - values[0]) / gap
  n = mu.size
  ups = int((mu == values[1]).sum())
  assert abs(ups - n * p) <= 5.5 * np.sqrt(n * p * (1 - p)) + 1, (ups, n * p)


def test_nearest_is_the_default_and_a_cast():
  """Default bf16 moments round to nearest (as a cast): the bits of `(0.1 * g).astype(bf16)`."""
  num_rows, dim = 16, 8
  rng = np.random.default_rng(1)
  g = rng.standard_normal((num_rows, dim)).astype(np.float32)
  grad = sparse.BCOO((jnp.asarray(g), jnp.arange(num_rows)[:, None]), shape=(num_rows, dim))
  params = {"t": jnp.zeros((num_rows, dim))}
  states = []
  for kwargs in ({}, {"moment_rounding": "nearest"}):
    opt = osa.sparse_adam(1e-2, mu_dtype=jnp.bfloat16, **kwargs)
    states.append(jax.jit(opt.update)({"t": grad}, opt.init(params), params)[1])
  expected = jnp.asarray(g * np.float32(1 - 0.9)).astype(jnp.bfloat16)
  for state in states:
    np.testing.assert_array_equal(
      np.asarray(state.mu["t"]).view(np.uint16), np.asarray(expected).view(np.uint16)
    )


def _train(opt, grads, params, state=None, path="default"):
  step = jax.jit(train_step(opt))
  state = opt.init(params) if state is None else state
  with on_path(path):
    for g in grads:
      params, state = step(params, state, {"t": g})
  return params, state


def _bits(tree):
  return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _random_grads(num_rows, dim, steps, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    rows = rng.integers(0, num_rows, 24)
    data = rng.standard_normal((24, dim)).astype(np.float32)
    out.append(sparse.BCOO((jnp.asarray(data), jnp.asarray(rows)[:, None]), shape=(num_rows, dim)))
  return out


@pytest.mark.parametrize("rowwise", [False, True], ids=["full", "rowwise"])
def test_two_runs_agree_and_a_resumed_run_continues_the_stream(rowwise):
  opt = osa.sparse_adam(
    1e-2,
    mu_dtype=jnp.bfloat16,
    nu_dtype=jnp.bfloat16,
    moment_rounding="stochastic",
    rowwise_second_moment=rowwise,
  )
  params = {"t": jnp.asarray(np.random.default_rng(2).standard_normal((64, 8)), jnp.float32)}
  grads = _random_grads(64, 8, 6, seed=3)
  first = _train(opt, grads, params)
  second = _train(opt, grads, params)
  assert _bits(first) == _bits(second)
  # Stop after 3 steps, move the state through the host (a checkpoint), resume.
  mid_params, mid_state = _train(opt, grads[:3], params)
  mid_params, mid_state = jax.tree.map(
    lambda x: jnp.asarray(np.asarray(x)), (mid_params, mid_state)
  )
  resumed = _train(opt, grads[3:], mid_params, mid_state)
  assert _bits(resumed) == _bits(first)
  # The stream moves on with the step count, the row and the slot.
  rows = jnp.arange(64, dtype=jnp.int32)
  base = np.asarray(rounding.random_bits(rounding.step_key(jnp.int32(1), 0), rows, 8))
  for other in (
    rounding.random_bits(rounding.step_key(jnp.int32(2), 0), rows, 8),
    rounding.random_bits(rounding.step_key(jnp.int32(1), 1), rows, 8),
    rounding.random_bits(rounding.step_key(jnp.int32(1), 0), rows + 1, 8),
  ):
    assert (np.asarray(other) == base).mean() < 0.01


def test_stochastic_rounding_keeps_small_updates_that_nearest_loses():
  """A constant gradient: round-to-nearest stalls `mu` below 1; stochastic tracks it on average."""
  num_rows, dim, steps = 64, 16, 150
  grads = [_grad(np.arange(num_rows), dim, 1.0, num_rows)] * steps
  params = {"t": jnp.zeros((num_rows, dim))}
  exact = 1 - 0.9**steps
  means = {}
  for mode in ("nearest", "stochastic"):
    opt = osa.sparse_adam(1e-3, mu_dtype=jnp.bfloat16, moment_rounding=mode)
    _, state = _train(opt, grads, params)
    means[mode] = float(np.asarray(state.mu["t"], np.float64).mean())
  # Nearest: 0.1 * (1 - m) drops below half an ulp of m (2^-9) once m > 0.98.
  assert means["nearest"] < exact - 0.01
  assert abs(means["stochastic"] - exact) < 0.002


def test_stochastic_with_float32_moments_is_nearest():
  opt_sr = osa.sparse_adam(1e-2, moment_rounding="stochastic")
  opt = osa.sparse_adam(1e-2)
  params = {"t": jnp.zeros((32, 4))}
  grads = _random_grads(32, 4, 3, seed=4)
  assert _bits(_train(opt_sr, grads, params)) == _bits(_train(opt, grads, params))


def test_refuses_an_unknown_rounding():
  with pytest.raises(ValueError, match=r"moment_rounding='up'.*'nearest', 'stochastic'"):
    osa.sparse_adam(moment_rounding="up")


def test_refuses_stochastic_rounding_to_float16_naming_the_leaf():
  opt = osa.sparse_adam(moment_rounding="stochastic", mu_dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"mu of the parameter at \['emb'\].*float16"):
    opt.init({"emb": jnp.zeros((4, 2))})
  opt = osa.sparse_adam(moment_rounding="stochastic")
  with pytest.raises(ValueError, match=r"\['w'\].*float16"):
    opt.init({"w": jnp.zeros((4, 2), jnp.float16)})


def test_schedule_and_chain_with_stochastic_bf16():
  """Through `optax.chain` and a schedule, every path stores the same bits."""
  opt = optax.chain(
    osa.lift_to_bcoo(optax.scale(0.5)),
    osa.sparse_adam(
      optax.linear_schedule(0.05, 0.01, 4),
      mu_dtype=jnp.bfloat16,
      nu_dtype=jnp.bfloat16,
      moment_rounding="stochastic",
    ),
  )
  params = {"t": jnp.zeros((48, 8))}
  grads = _random_grads(48, 8, 4, seed=5)
  runs = [_bits(_train(opt, grads, params, path=p)) for p in PATHS]
  assert runs[0] == runs[1] == runs[2]


SAME_BITS_CASES = [
  (dtypes, mode, rowwise)
  for dtypes in [("bfloat16", "bfloat16"), ("bfloat16", None), (None, "bfloat16")]
  for mode in ("nearest", "stochastic")
  for rowwise in (False, True)
]
# Default tier: each moment in bfloat16 alone and both, each rounding, full and row-wise `nu`.
SAME_BITS_DEFAULT = [
  (("bfloat16", "bfloat16"), "stochastic", True),
  (("bfloat16", None), "stochastic", False),
  ((None, "bfloat16"), "nearest", False),
  ((None, "bfloat16"), "stochastic", True),
]


@pytest.mark.parametrize(
  "dtypes, mode, rowwise",
  tiered(SAME_BITS_CASES, lambda case: case not in SAME_BITS_DEFAULT),
  ids=[f"{d}-{m}-{'rowwise' if r else 'full'}" for d, m, r in SAME_BITS_CASES],
)
def test_every_path_stores_the_same_bits(dtypes, mode, rowwise):
  """The fused CPU kernels, the XLA ops and the accelerator step, with NaN and inf entries."""
  mu_dtype, nu_dtype = dtypes
  opt = osa.sparse_adam(
    1e-2,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
    moment_rounding=mode,
    rowwise_second_moment=rowwise,
  )
  params = {"t": jnp.asarray(np.random.default_rng(6).standard_normal((40, 12)), jnp.float32)}
  grads = _random_grads(40, 12, 3, seed=7)
  data = np.array(grads[1].data)
  data[0, :3] = [np.nan, np.inf, -np.inf]
  grads[1] = sparse.BCOO((jnp.asarray(data), grads[1].indices), shape=grads[1].shape)
  runs = [_bits(_train(opt, grads, params, path=p)) for p in PATHS]
  assert runs[0] == runs[1] == runs[2]


SHARD_CASES = [(path, rowwise) for rowwise in (False, True) for path in PATHS]


@pytest.mark.parametrize(
  "path, rowwise",
  # Each path once in the default tier, full and row-wise `nu` between them.
  tiered(
    SHARD_CASES, lambda case: case not in [(PATHS[0], True), (PATHS[1], False), (PATHS[2], True)]
  ),
  ids=[f"{'rowwise' if r else 'full'}-{p}" for p, r in SHARD_CASES],
)
def test_a_shard_given_its_first_row_draws_the_whole_tables_bits(path, rowwise):
  """A step on the upper half of a table with `row_offset` = its first global row (as the
  routed step gives each shard) stores the bits of that half of the whole table's step."""
  from optax_sparse_adam._backends import dispatch
  from optax_sparse_adam._core import bcoo, rules
  from optax_sparse_adam._core.row_rules import adam, rowwise_adam

  num_rows, dim, half = 64, 16, 32
  rng = np.random.default_rng(5)
  rows = jnp.asarray(rng.integers(half, num_rows, 40), jnp.int32)  # upper half only
  values = jnp.asarray(rng.standard_normal((40, dim)), jnp.float32)
  rule = rowwise_adam.RowwiseAdamRule() if rowwise else adam.AdamRule()
  config = rules.StepConfig(moment_rounding="stochastic")
  hyper = adam.hyperparams_of(adam.adam_coefficients(1e-2, 0.9, 0.999, 1e-8))

  def step(rows, tables, num_rows, row_offset):
    plan = rules.StepPlan(bcoo.RowLayout((num_rows,), (dim,)), rule, config)
    inputs = rules.StepInputs(rows, values, tables, jnp.int32(3), hyper, None, row_offset)
    return jax.jit(dispatch.masked_step, static_argnums=1)(inputs, plan).tables.slots

  def tables(n):
    full = jnp.asarray(rng.standard_normal((n, dim)), jnp.bfloat16)
    nu = jnp.abs(full[:, 0]) if rowwise else jnp.abs(full)
    return rules.Tables({"mu": full, "nu": nu})

  whole = tables(num_rows)
  upper = rules.Tables({name: table[half:] for name, table in whole.slots.items()})
  with on_path(path):
    expected = step(rows, whole, num_rows, None)
    shard = step(rows - half, upper, half, jnp.int32(half))
    unshifted = step(rows - half, upper, half, None)
  for name in ("mu", "nu"):
    got, want = np.asarray(shard[name]), np.asarray(expected[name][half:])
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=name)
  # Without the offset the shard's rows hash as rows 0..31: other bits.
  assert not np.array_equal(np.asarray(unshifted["mu"]), np.asarray(expected["mu"][half:]))
