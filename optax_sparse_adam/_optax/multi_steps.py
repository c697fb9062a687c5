"""`sparse_multi_steps`: gradient accumulation for BCOO gradients, in a buffer of static size.

`optax.MultiSteps` accumulates by adding gradients densely. Here each table's
entries are appended to a `RowBuffer` of `max_nse` entries and coalesced when
the inner transformation runs, every `every_k_schedule` mini-steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo, row_update
from optax_sparse_adam._core.errors import (
  describe,
  flatten_grads,
  flatten_up_to,
  leaves_up_to,
  path_str,
)
from optax_sparse_adam._optax import composition


class RowBuffer(NamedTuple):
  """The BCOO gradients of one parameter over the mini-steps of a cycle.

  Attributes:
    rows: int32 `(every_k * max_nse,)` row ids; out of range for padding.
    values: `(every_k * max_nse, *row_shape)` gradient rows.
  """

  rows: jax.Array
  values: jax.Array


class SparseMultiStepsState(NamedTuple):
  """State of `sparse_multi_steps`.

  Attributes:
    mini_step: int32 mini-steps done in the current cycle, `0 .. every_k - 1`.
    gradient_step: int32 number of steps of the inner transformation.
    inner_opt_state: the inner transformation's state.
    acc_grads: per parameter, a `RowBuffer` (BCOO gradients) or the running sum
      of dense gradients.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any


def sparse_multi_steps(
  inner: optax.GradientTransformation,
  every_k: int,
  *,
  max_nse: int | Any,
  use_grad_mean: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""`optax.MultiSteps` for BCOO gradients: accumulate `every_k` mini-steps, then step once.

  .. math::
    g = \frac{1}{k} \sum_{i=1}^{k} g_i \quad (\text{or the sum}), \qquad
    u = \mathrm{inner}(g) \text{ every } k \text{ mini-steps, else } 0

  The BCOO gradients of a cycle are kept side by side (not densified) in a
  buffer of `every_k * max_nse` rows per parameter, and handed to `inner` as
  one BCOO with duplicate rows, which `sparse_adam` sums; so a row touched in
  any mini-step of the cycle is updated once, with the mean gradient, exactly
  as `optax.MultiSteps` does densely on the touched rows. Mini-steps emit
  all-padding BCOO updates (zero data at out-of-range indices).

  The buffer needs static sizes, fixed at `init`: each BCOO gradient may hold
  at most `max_nse` entries (fewer are padded, more are refused at trace time)
  and must index rows (`n_sparse == 1`, as from an embedding lookup). Dense
  gradients (leaves whose `max_nse` is None) are summed densely.

  A None gradient (a table not looked up in that mini-step) adds nothing; the
  rows of the cycle's other mini-steps are still stepped, and a table with no
  gradient in the whole cycle takes no inner step (as torch leaves its `.grad`
  None). This needs `params` in `update`, and at most 4 None BCOO gradients in
  one mini-step (each doubles the branches of the compiled step).

  Args:
    inner: the transformation to step, e.g. `sparse_adam(...)` or an
      `optax.multi_transform` of sparse and dense optimizers.
    every_k: number of mini-steps per step (a Python int: it sizes the buffer).
    max_nse: the largest `nse` of the BCOO gradients: an int for every leaf, or a
      pytree like the params with an int per BCOO leaf and None per dense leaf.
    use_grad_mean: average the gradients of a cycle (True) or sum them.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `SparseMultiStepsState`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_multi_steps(osa.sparse_adam(0.1), every_k=2, max_nse=1)
    >>> state = opt.init(jnp.zeros((4, 1)))
    >>> g = sparse.BCOO((jnp.ones((1, 1)), jnp.array([[2]])), shape=(4, 1))
    >>> u, state = opt.update(g, state)
    >>> float(abs(u.todense()).sum())
    0.0
    >>> u, state = opt.update(g, state)
    >>> round(float(u.todense()[2, 0]), 4)
    -0.1

  References:
    `optax.MultiSteps`, https://optax.readthedocs.io/en/latest/api/optimizer_wrappers.html
  """
  if not isinstance(every_k, int) or isinstance(every_k, bool) or every_k < 1:
    raise ValueError(
      f"sparse_multi_steps: every_k must be a Python int >= 1 (it sizes the "
      f"gradient buffer), got {every_k!r}. Schedules of k are not supported."
    )
  inner = optax.with_extra_args_support(inner)
  who = "sparse_multi_steps"

  def caps_of(params: Any) -> list[Any]:
    params_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    if isinstance(max_nse, int) and not isinstance(max_nse, bool):
      caps = [max_nse] * len(params_with_path)
    else:
      caps = flatten_up_to(
        treedef,
        max_nse,
        lambda: (
          f"{who}: max_nse must be an int or a pytree with the params' structure "
          f"{treedef} (an int per BCOO leaf, None per dense leaf), got {max_nse!r}."
        ),
      )
    for (path, _), cap in zip(params_with_path, caps, strict=True):
      if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise ValueError(
          f"{who}: max_nse for the parameter at {path_str(path)} must "
          f"be a positive int or None, got {cap!r}."
        )
    return caps

  def init_fn(params: optax.Params) -> SparseMultiStepsState:
    caps = caps_of(params)
    leaves, treedef = jax.tree.flatten(params)
    acc: list[jax.Array | RowBuffer] = []
    for param, cap in zip(leaves, caps, strict=True):
      param = jnp.asarray(param)
      if cap is None:
        acc.append(jnp.zeros_like(param))
      elif param.ndim < 1:
        raise ValueError(
          f"{who}: a scalar parameter cannot take BCOO gradients; set its max_nse to None."
        )
      else:
        size = every_k * cap
        acc.append(
          RowBuffer(
            rows=jnp.full((size,), param.shape[0], jnp.int32),
            values=jnp.zeros((size,) + param.shape[1:], param.dtype),
          )
        )
    return SparseMultiStepsState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      inner_opt_state=inner.init(params),
      acc_grads=jax.tree.unflatten(treedef, acc),
    )

  def update_fn(
    updates: optax.Updates,
    state: SparseMultiStepsState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, SparseMultiStepsState]:
    leaves_with_path, treedef = flatten_grads(updates)
    acc_leaves = treedef.flatten_up_to(state.acc_grads)
    param_leaves = leaves_up_to(treedef, params, "params")
    # Per leaf a RowBuffer, an array or None, each kind where the gradient and state have it.
    new_acc: list[Any] = []
    cycle_grads, missing = [], []
    for (path, grad), acc, param in zip(leaves_with_path, acc_leaves, param_leaves, strict=True):
      if isinstance(acc, RowBuffer) and grad is None:
        # Nothing to add, but this mini-step's slot still holds the previous
        # cycle's rows, and the cycle's earlier rows must still be stepped.
        missing.append(len(new_acc))
        new_acc.append(_mark_not_looked_up(acc, state.mini_step, every_k))
        cycle_grads.append(_no_rows(acc, param, every_k, path, who))
        continue
      if grad is None:
        new_acc.append(acc)
      elif isinstance(acc, RowBuffer):
        new_acc.append(_buffer_rows(grad, acc, state.mini_step, every_k, path, who))
      elif isinstance(grad, sparse.BCOO):
        raise TypeError(
          f"{who}: the gradient at {path_str(path)} is a BCOO but its max_nse was "
          "None (a dense leaf). Give its largest nse in max_nse."
        )
      else:
        new_acc.append(acc + jnp.asarray(grad).astype(acc.dtype))
      cycle_grads.append(grad)
    scale = 1.0 / every_k if use_grad_mean else 1.0
    for i, (grad, acc) in enumerate(zip(cycle_grads, new_acc, strict=True)):
      if grad is None:
        continue
      if isinstance(acc, RowBuffer):
        cycle_grads[i] = sparse.BCOO(
          (
            (acc.values * jnp.asarray(scale, acc.values.dtype)).astype(grad.dtype),
            acc.rows[:, None],
          ),
          shape=grad.shape,
        )
      else:
        cycle_grads[i] = (acc * jnp.asarray(scale, acc.dtype)).astype(jnp.result_type(grad))
    cycle_grads = treedef.unflatten(cycle_grads)
    emit = state.mini_step == every_k - 1

    if len(missing) > _MAX_MISSING:
      paths = [path_str(leaves_with_path[i][0]) for i in missing]
      raise ValueError(
        f"{who}: {len(missing)} BCOO gradients are None in this mini-step ({', '.join(paths)}); "
        f"at most {_MAX_MISSING} can be (each doubles the compiled step, to step a table "
        "only if it was looked up in the cycle). Look the others up in every mini-step, "
        "with padding ids if they have nothing to look up (their step then counts, as "
        "torch's does for a lookup of padding_idx only)."
      )
    # A table with a None gradient now was maybe looked up earlier in the cycle:
    # the inner step sees it as None (its step count does not advance, as torch's
    # .grad stays None) only if none of its slots was written by a gradient.
    looked_up = [jnp.any(new_acc[i].rows != _NOT_LOOKED_UP) for i in missing]

    def do_update(operands):
      grads, inner_state, params, extra_args = operands
      if not missing:
        return inner.update(grads, inner_state, params, **extra_args)
      full = jax.eval_shape(lambda: inner.update(grads, inner_state, params, **extra_args))[0]
      grad_leaves = treedef.flatten_up_to(grads)

      def branch(which: int) -> Any:
        def run(_):
          leaves = list(grad_leaves)
          for bit, i in enumerate(missing):
            if not which >> bit & 1:
              leaves[i] = None
          new_updates, new_state = inner.update(
            treedef.unflatten(leaves), inner_state, params, **extra_args
          )
          out = treedef.flatten_up_to(new_updates)
          shapes = treedef.flatten_up_to(full)
          out = [
            composition.empty_updates_like(t) if u is None else u
            for u, t in zip(out, shapes, strict=True)
          ]
          return treedef.unflatten(out), new_state

        return run

      index = sum(flag.astype(jnp.int32) << bit for bit, flag in enumerate(looked_up))
      return lax.switch(index, [branch(w) for w in range(2 ** len(missing))], None)

    operands = (cycle_grads, state.inner_opt_state, params, extra_args)
    out_shapes, _ = jax.eval_shape(do_update, operands)
    new_updates, new_inner_state = lax.cond(
      emit, do_update, lambda ops: (composition.empty_updates_like(out_shapes), ops[1]), operands
    )
    # The buffers are overwritten slot by slot each cycle; only dense sums reset.
    reset = [
      acc if isinstance(acc, RowBuffer) else jnp.where(emit, jnp.zeros_like(acc), acc)
      for acc in new_acc
    ]
    return new_updates, SparseMultiStepsState(
      mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
      gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step), state.gradient_step),
      inner_opt_state=new_inner_state,
      acc_grads=treedef.unflatten(reset),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Rows of a buffer slot whose mini-step had no gradient; _buffer_rows never writes
# a negative row, and every consumer reads one as padding.
_NOT_LOOKED_UP = -1
_MAX_MISSING = 4


def _mark_not_looked_up(buffer: RowBuffer, mini_step: jax.Array, every_k: int) -> RowBuffer:
  """The buffer with this mini-step's slot emptied and marked as not looked up."""
  cap = buffer.rows.shape[0] // every_k
  start = mini_step * cap
  rows = jnp.full((cap,), _NOT_LOOKED_UP, jnp.int32)
  values = jnp.zeros((cap,) + buffer.values.shape[1:], buffer.values.dtype)
  return RowBuffer(
    rows=lax.dynamic_update_slice_in_dim(buffer.rows, rows, start, axis=0),
    values=lax.dynamic_update_slice_in_dim(buffer.values, values, start, axis=0),
  )


def _no_rows(buffer: RowBuffer, param: Any, every_k: int, path: Any, who: str) -> sparse.BCOO:
  """An all-padding BCOO gradient for a mini-step whose gradient is None."""
  if param is None:
    raise ValueError(
      f"{who}: the gradient at {path_str(path)} is None in this mini-step (a table "
      "not looked up), and its shape is needed to step the rows of the cycle's other "
      "mini-steps. Pass params to update (SparseOptimizer and SparseTrainState do)."
    )
  cap = buffer.rows.shape[0] // every_k
  template = sparse.BCOO(
    (
      jnp.zeros((cap,) + buffer.values.shape[1:], buffer.values.dtype),
      jnp.zeros((cap, 1), jnp.int32),
    ),
    shape=tuple(jnp.shape(param)),
  )
  return composition.empty_updates_like(template)


def _buffer_rows(
  grad: Any, buffer: RowBuffer, mini_step: jax.Array, every_k: int, path: Any, who: str
) -> RowBuffer:
  """Writes a BCOO gradient into its mini-step's slot of the buffer, padded to the slot."""
  cap = buffer.rows.shape[0] // every_k
  if not isinstance(grad, sparse.BCOO):
    raise TypeError(
      f"{who}: the gradient at {path_str(path)} is dense ({describe(grad)}) but "
      "its max_nse declares a BCOO leaf. Set its max_nse to None."
    )
  num_rows = int(grad.shape[0]) if grad.ndim else 0
  layout = composition.checked_row_layout(grad, grad.shape, path, who)
  if grad.n_sparse != 1:
    raise ValueError(
      f"{who}: the BCOO gradient at {path_str(path)} has n_sparse={grad.n_sparse}; "
      "the accumulation buffer holds whole rows (n_sparse=1). Convert it with "
      "jax.experimental.sparse.bcoo_update_layout(grad, n_dense=grad.ndim - 1)."
    )
  if grad.nse > cap:
    raise ValueError(
      f"{who}: the BCOO gradient at {path_str(path)} has nse={grad.nse} entries "
      f"but the buffer holds max_nse={cap} per mini-step; the nse of its "
      f"gradients varies beyond what init sized. Build sparse_multi_steps with "
      f"max_nse >= {grad.nse} for this leaf, or fix the nse with "
      "grad.sum_duplicates(nse=...)."
    )
  if buffer.values.shape[1:] != tuple(layout.dense_shape):
    raise ValueError(
      f"{who}: the BCOO gradient at {path_str(path)} has rows of shape "
      f"{layout.dense_shape}, but the buffer was built for {buffer.values.shape[1:]}."
    )
  rows = bcoo.linear_rows(row_update.checked_indices(grad, path, what="gradient"), layout)
  pad = cap - grad.nse
  rows = jnp.concatenate([rows, jnp.full((pad,), num_rows, jnp.int32)])
  values = jnp.concatenate(
    [
      grad.data.astype(buffer.values.dtype),
      jnp.zeros((pad,) + layout.dense_shape, buffer.values.dtype),
    ]
  )
  start = mini_step * cap
  return RowBuffer(
    rows=lax.dynamic_update_slice_in_dim(buffer.rows, rows, start, axis=0),
    values=lax.dynamic_update_slice_in_dim(buffer.values, values, start, axis=0),
  )
