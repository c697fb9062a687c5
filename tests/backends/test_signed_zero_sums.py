"""A row whose gradient entries are all -0.0 sums to -0.0 on every path, as torch's coalesce.

torch's `coalesce` copies a row's first entry and adds the others, so a lone -0.0, or
-0.0s alone, stay -0.0; every coalescing here sums from -0.0 (the identity of float
addition), which is the same. The sign shows in a -0.0 parameter's SGD or Adagrad step:
`-0.0 - lr * -0.0` is +0.0, `-0.0 - lr * +0.0` is -0.0. Checked: each coalescing (the CPU
kernel, the XLA ops' three ways, the table-batched one) against torch's coalesce, bit for
bit, in float32, bfloat16 and float16; and jitted steps of SGD, Adagrad, Adam and FTRL on every
CPU path (fused kernels, generic kernels, row program, XLA ops, the accelerator step
forced on the CPU) against the XLA ops' and, for SGD and Adagrad, against torch's, over a
gradient of one entry (which XLA's simplifier once took alone, keeping its -0.0) and one
of several (where the sum from +0.0 made -0.0 a +0.0 on every path).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core import coalesce, coalesce_tables
from tests._helpers import BACKEND, train_step
from tests.backends.test_row_store import _bits

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU paths run on the CPU only"
)

ROWS, WIDTH = 6, 4
Z = -0.0
# name: (ids, values). -1 and ROWS are padding (dropped).
GRADS = {
  # One entry: each of its -0.0s alone in its column.
  "one": ([2], [[Z, 1.0, Z, 2.0]]),
  # Row 2: one entry among others; row 4: two entries, -0.0 + -0.0 (column 0) and
  # -0.0 + +0.0 (column 1); row 5: a +0.0 alone (column 0).
  "many": (
    [4, 2, -1, 5, 4, ROWS],
    [
      [Z, Z, 1.0, Z],
      [Z, 1.0, Z, 2.0],
      [Z, Z, Z, Z],
      [0.0, 2.0, Z, 1.0],
      [Z, 0.0, Z, 1.0],
      [1.0, Z, 1.0, Z],
    ],
  ),  # fmt: skip
}
# -0.0 everywhere: a zero gradient's sign decides the sign of the parameter's new zero.
PARAM = np.full((ROWS, WIDTH), -0.0, np.float32)


def _torch_coalesced(ids, values):
  """torch's coalesce of the in-range entries: its rows and its values' bits."""
  ids, values = np.asarray(ids), np.asarray(values, np.float32)
  keep = (ids >= 0) & (ids < ROWS)
  grad = torch.sparse_coo_tensor(
    torch.tensor(ids[keep])[None], torch.tensor(values[keep]), (ROWS, WIDTH)
  ).coalesce()
  return grad.indices()[0].numpy(), grad.values().numpy()


def _coalescings(ids, values):
  """Each coalescing's `CoalescedRows` (padding slots last), by name."""
  rows = jnp.where((ids >= 0) & (ids < ROWS), ids, ROWS).astype(jnp.int32)
  # With another table's gradient in the same sort, first and second.
  this = coalesce_tables.TableGrad(rows, values, ROWS)
  other = coalesce_tables.TableGrad(jnp.asarray([1, 1], jnp.int32), values[:2] + 1, ROWS)
  return {
    "cpu_kernel": kernels.coalesce_and_gather(rows, values, ROWS, [])[0],
    "search": coalesce.coalesce_rows(ids, values, ROWS),
    "one_sort": coalesce.coalesce_by_one_sort(rows, values, ROWS),
    "tables_first": coalesce_tables.coalesce_tables([this, other])[0],
    "tables_second": coalesce_tables.coalesce_tables([other, this])[1],
  }


# Both gradients' coalescings in one function (one compile a dtype).
def _all_coalescings(grads):
  return {name: _coalescings(ids, values) for name, (ids, values) in grads.items()}


@pytest.mark.parametrize(
  ("dtype", "use_jit"),
  [
    (jnp.float32, True),
    (jnp.bfloat16, True),
    pytest.param(jnp.float16, True, marks=pytest.mark.slow),
    pytest.param(jnp.float32, False, id="eager", marks=pytest.mark.slow),  # op by op: 7 s
  ],
)
def test_every_coalescing_keeps_torchs_signed_zeros(dtype, use_jit):
  grads = {
    name: (jnp.asarray(ids), jnp.asarray(values, dtype)) for name, (ids, values) in GRADS.items()
  }
  runs = (jax.jit(_all_coalescings) if use_jit else _all_coalescings)(grads)
  for name, (ids, values) in GRADS.items():
    want_rows, want_values = _torch_coalesced(ids, values)
    want_values = np.asarray(jnp.asarray(want_values, dtype))  # every value exact in 16 bits
    n = len(want_rows)
    for way, got in runs[name].items():
      np.testing.assert_array_equal(np.asarray(got.rows[:n]), want_rows, err_msg=way)
      np.testing.assert_array_equal(_bits(got.values[:n]), _bits(want_values), err_msg=way)
      assert not _bits(got.values[n:]).any(), way  # padding slots hold +0.0


OPTS = {
  "sgd": lambda: osa.sparse_sgd(0.5),
  "adagrad": lambda: osa.sparse_adagrad(0.5, eps=1e-10),
  "adam": lambda: osa.sparse_adam(0.1),
  "ftrl": lambda: osa.sparse_ftrl(0.2),
}
PATHS = {
  "fused": {},
  "generic_kernels": {"forced": choice.GENERIC_KERNELS, "row_program": False},
  "row_program": {"forced": choice.GENERIC_KERNELS},
  "accelerator": {"forced": choice.ACCELERATOR},
  "xla_ops": {"forced": choice.GENERIC_XLA},
}


def _torch_param(name, ids, values):
  """torch's SGD or Adagrad step from `PARAM`: the parameter. SGD is given the gradient
  coalesced (torch adds an uncoalesced one entry by entry; here duplicates are summed
  first, docs/limits.md); Adagrad coalesces it itself."""
  ids, values = np.asarray(ids), np.asarray(values, np.float32)
  keep = (ids >= 0) & (ids < ROWS)
  p = torch.nn.Parameter(torch.tensor(PARAM))
  if name == "sgd":
    opt = torch.optim.SGD([p], lr=0.5)
  else:
    opt = torch.optim.Adagrad([p], lr=0.5, eps=1e-10)
  grad = torch.sparse_coo_tensor(
    torch.tensor(ids[keep])[None], torch.tensor(values[keep]), (ROWS, WIDTH)
  )
  p.grad = grad.coalesce() if name == "sgd" else grad
  opt.step()
  return p.detach().numpy().copy()


# SGD and Adagrad (their fused kernels, the row program, torch's steps) in the default tier.
@pytest.mark.parametrize(
  "names",
  [("sgd", "adagrad"), pytest.param(("adam", "ftrl"), marks=pytest.mark.slow)],
  ids=["sgd_adagrad", "adam_ftrl"],
)
def test_every_path_stores_the_same_signed_zeros_as_the_xla_ops_and_torch(names):
  # The rules on both gradients in one step (one compile a path).
  keys = [(name, grad_name) for name in names for grad_name in GRADS]
  params = {f"{name}/{g}": jnp.asarray(PARAM) for name, g in keys}
  grads = {
    f"{name}/{g}": sparse.BCOO(
      (jnp.asarray(GRADS[g][1], jnp.float32), jnp.asarray(GRADS[g][0], jnp.int32)[:, None]),
      shape=(ROWS, WIDTH),
    )
    for name, g in keys
  }
  labels = {f"{name}/{g}": name for name, g in keys}
  opt = optax.multi_transform({name: OPTS[name]() for name in names}, labels)
  step = jax.jit(train_step(opt))
  runs = {}
  for path, switches in PATHS.items():
    with choice.choose(**switches):
      new_params, state = step(params, opt.init(params), grads)
    runs[path] = jax.tree.map(_bits, (new_params, state))
  for path, leaves in runs.items():
    for got, want in zip(jax.tree.leaves(leaves), jax.tree.leaves(runs["xla_ops"]), strict=True):
      np.testing.assert_array_equal(got, want, err_msg=path)
  # torch's values are exact here (lr 0.5, entries 0, 1 and 2).
  for name in set(names) & {"sgd", "adagrad"}:
    for g, (ids, values) in GRADS.items():
      want = _bits(_torch_param(name, ids, values))
      np.testing.assert_array_equal(runs["xla_ops"][0][f"{name}/{g}"], want, err_msg=f"{name} {g}")
