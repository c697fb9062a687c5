"""Shared test helpers: an independent NumPy reference, the train step, HLO checks.

`NumpySparseAdam` does not call the library. Its bookkeeping is dense on
purpose (the touched set is a boolean mask built with np.add.at), so nothing
in it shares code or structure with the row-sorting implementation under test.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa

BACKEND = jax.default_backend()


def cpu_only(what: str) -> pytest.MarkDecorator:
  """Skips a test of a fact that holds on the CPU only, naming the backend it would run on."""
  return pytest.mark.skipif(
    BACKEND != "cpu", reason=f"{what} holds on the CPU only; this backend is {BACKEND}"
  )


def tiered(cases, slow) -> list:
  """`cases` as parameters, those for which `slow(case)` holds marked for the slow tier.

  For matrices whose every cell is a check worth keeping but whose eager or repeated
  cells cost the default command its time budget: one representative stays in the
  default tier, the rest run with `-m slow` (CI runs both).
  """
  return [
    pytest.param(
      *(c if isinstance(c, tuple) else (c,)), marks=[pytest.mark.slow] if slow(c) else []
    )
    for c in cases
  ]


STEP_PATHS = ["default", "xla_ops", "accelerator"]


def on_path(path: str):
  """A context that runs steps on `path` (one of `STEP_PATHS`), forced on any backend."""
  from optax_sparse_adam._backends import choice
  from optax_sparse_adam._backends.cpu import kernels

  if path == "xla_ops":
    return kernels.use_cpu_kernels(False)
  if path == "accelerator":
    return choice.choose(forced=choice.ACCELERATOR)
  return choice.choose()


def fmix32(x):
  """MurmurHash3's 32-bit finalizer in NumPy: the tests' own copy of `rounding`'s hash."""
  x = np.uint32(x) if np.isscalar(x) else np.asarray(x).astype(np.uint32)
  x ^= x >> np.uint32(16)
  x = (x * np.uint32(0x85EBCA6B)).astype(np.uint32)
  x ^= x >> np.uint32(13)
  x = (x * np.uint32(0xC2B2AE35)).astype(np.uint32)
  return x ^ (x >> np.uint32(16))


def assert_paths_agree(a, b) -> None:
  """Two paths' results: equal in every bit on the CPU, close on other backends.

  On the CPU every path sums a row's duplicates from -0.0 in input order, so their
  bits agree. A GPU's scatter-adds sum duplicates in no fixed order (docs/performance/
  gpu.md: run to run too, without XLA's deterministic-ops flag), so there the paths
  agree to a few roundings of the leaf's dtype, relative to the leaf's largest value.
  """
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  floats = [x.dtype for x in leaves_b if jnp.issubdtype(x.dtype, jnp.inexact)]
  # Leaves computed from 16-bit values (float32 moments of bf16 params) carry their
  # roundings: the tolerance is the narrowest float dtype's.
  narrowest = min(floats, key=lambda d: d.itemsize, default=np.dtype(np.float32))
  tol = (8 if narrowest.itemsize < 4 else 64) * float(jnp.finfo(narrowest).eps)
  for x, y in zip(leaves_a, leaves_b, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    if BACKEND == "cpu" or not jnp.issubdtype(x.dtype, jnp.inexact):
      np.testing.assert_array_equal(x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}"))
      continue
    wide_x, wide_y = x.astype(np.float64), y.astype(np.float64)
    finite = np.isfinite(wide_y)
    scale = float(np.max(np.abs(wide_y[finite]), initial=1.0))
    np.testing.assert_allclose(wide_x, wide_y, rtol=tol, atol=tol * scale, equal_nan=True)


class NumpySparseAdam:
  """torch.optim.SparseAdam for one parameter, in `dtype` arithmetic (float64 by default)."""

  def __init__(self, param, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, dtype=None):
    self.dtype = np.dtype(dtype or np.float64)
    self.param = np.array(param, dtype=self.dtype)
    self.exp_avg = np.zeros_like(self.param)
    self.exp_avg_sq = np.zeros_like(self.param)
    self.step_count = 0
    self.lr, self.betas, self.eps, self.maximize = lr, betas, eps, maximize

  def step(self, indices, values, lr=None):
    """One step; indices (nse, n_sparse), out-of-range ones are padding; values (nse, *dense)."""
    lr = self.lr if lr is None else lr
    b1, b2 = self.betas
    self.step_count += 1
    if len(values) == 0:  # an empty gradient still counts a step, as in torch
      return
    values = np.asarray(values, dtype=self.dtype)
    indices = np.asarray(indices)
    n_sparse = indices.shape[1]
    sparse_shape = self.param.shape[:n_sparse]
    keep = np.all((indices >= 0) & (indices < np.array(sparse_shape)), axis=1)
    indices, values = indices[keep], values[keep]
    if self.maximize:
      values = -values
    grad = np.zeros_like(self.param)
    touched = np.zeros(sparse_shape, dtype=bool)
    np.add.at(grad, tuple(indices.T), values)
    touched[tuple(indices.T)] = True
    if not touched.any():
      return
    t = self.dtype.type
    g = grad[touched]
    m_old, v_old = self.exp_avg[touched], self.exp_avg_sq[touched]
    m_upd = (g - m_old) * t(1 - b1)
    v_upd = (g * g - v_old) * t(1 - b2)
    m_new = m_old + m_upd
    v_new = v_old + v_upd
    denom = np.sqrt(v_new) + t(self.eps)
    step_size = lr * math.sqrt(1 - b2**self.step_count) / (1 - b1**self.step_count)
    self.exp_avg[touched] = m_new
    self.exp_avg_sq[touched] = v_new
    self.param[touched] = self.param[touched] + (-t(step_size)) * (m_new / denom)


def padded_grad(ids, values, shape, nse: int):
  """A BCOO gradient of `(ids, values)` padded to `nse` entries with out-of-range rows.

  Padding entries (row `shape[0]`, zero values) are what BCOO itself produces, and every
  path skips them; a fixed `nse` gives every step of a run one shape, so a jitted step is
  compiled once per run rather than once per distinct number of ids (the suite's time).
  """
  from jax.experimental import sparse

  ids = np.asarray(ids, np.int32).reshape(-1)
  values = np.asarray(values)
  if len(ids) > nse:
    raise ValueError(f"{len(ids)} ids do not fit in nse={nse}")
  pad = nse - len(ids)
  ids = np.concatenate([ids, np.full(pad, shape[0], np.int32)])
  values = np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
  return sparse.BCOO((jnp.asarray(values), jnp.asarray(ids)[:, None]), shape=tuple(shape))


def train_step(opt: optax.GradientTransformation):
  """`step(params, state, grads) -> (params, state)` for `opt`; jit and donate it as needed."""

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  return step


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """Maps each computation's name to its instruction lines; the entry is under 'ENTRY'."""
  computations: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header and not line.startswith(" "):
      current = "ENTRY" if header.group(1) else header.group(2)
      computations[current] = []
    elif current is not None and line.strip() and line.strip() != "}":
      computations[current].append(line.strip())
  return computations


def table_shaped_values(hlo_text: str, shape: str) -> list[tuple[str, str]]:
  """`(opcode, detail)` of every entry instruction whose result has `shape`, e.g. 'f32[1000,8]'.

  For a fusion, `detail` is the opcode of its fused root (a wrapped scatter fuses
  to 'scatter'); for a custom call that writes into one of its operands (the CPU
  kernels), 'in-place custom-call'; otherwise it is the opcode again.
  """
  computations = _computations(hlo_text)
  pattern = re.compile(r"=\s*" + re.escape(shape) + r"\{[^}]*\}\s+([\w\-]+)\(")
  values = []
  for line in computations["ENTRY"]:
    match = pattern.search(line)
    if not match:
      continue
    opcode = match.group(1)
    detail = opcode
    if opcode == "fusion":
      called = re.search(r"calls=%([\w.\-]+)", line).group(1)
      root = next(x for x in computations[called] if x.startswith("ROOT"))
      detail = re.search(r"=\s*\S+\s+([\w\-]+)\(", root).group(1)
    elif opcode == "custom-call" and "output_to_operand_aliasing" in line:
      detail = "in-place custom-call"
    values.append((opcode, detail))
  return values


def dense_table_temporaries(compiled, shape: str, num_donated: int) -> list[str]:
  """Problems with `shape`-d arrays in a compiled step; empty when there is no V x D temporary.

  Allowed: `num_donated` parameters (the table and its moments), scatters into
  them (the row updates, and the step's scratch marks in the first moment), the
  CPU kernels' custom calls that write into their operand, bitcasts and tuple
  plumbing. Also checked: the donated buffers alias outputs,
  and XLA's temporary allocation is smaller than one table, so every scatter
  updates a donated buffer in place rather than a copy of it.
  """
  text = compiled.as_text()
  values = table_shaped_values(text, shape)
  problems = []
  parameters = [v for v in values if v[0] == "parameter"]
  if len(parameters) != num_donated:
    problems.append(f"{len(parameters)} {shape} parameters, expected {num_donated}")
  plumbing = {"parameter", "bitcast", "get-tuple-element", "tuple"}
  writes = [v for v in values if v[0] not in plumbing]
  others = [v for v in writes if v[1] not in ("scatter", "in-place custom-call")]
  if others:
    problems.append(f"{shape} values that are not scatters into a donated buffer: {others}")
  if "input_output_alias" not in text:
    problems.append("no input_output_alias: the buffers were not donated")
  rows, cols = (int(d) for d in re.findall(r"\d+", shape.split("[")[1]))
  table_bytes = rows * cols * 4
  temp = compiled.memory_analysis().temp_size_in_bytes
  if temp >= table_bytes:
    problems.append(f"temporary allocation of {temp} bytes >= one table ({table_bytes})")
  return problems
