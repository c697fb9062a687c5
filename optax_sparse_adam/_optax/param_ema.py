"""A lazy exponential moving average of the parameters, for evaluation and serving.

Polyak averaging keeps `ema = decay * ema + (1 - decay) * param` after every step. For an
embedding table that is a pass over every row at every step, although a step changes a
few rows. Between two steps that touch it a row's parameter is constant, so its average
after `k` idle steps has a closed form, `param + decay**k * (ema - param)`, as catch-up
uses for the moments (docs/catch_up.md). `sparse_param_ema` therefore brings a row's
average up to date only when the row is stepped (its idle steps, then this step), and
keeps the step it was last brought up to date at; `ema_params` brings every row up to
date when the average is read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo, coalesce, row_update
from optax_sparse_adam._core.errors import flatten_grads, leaves_up_to, path_str
from optax_sparse_adam._core.set_rows import SetRowsUpdate


class ParamEMAState(NamedTuple):
  """The state of `sparse_param_ema`.

  Attributes:
    step: int32, the steps taken.
    decay: float32, the decay (kept so that `ema_params` needs only the state).
    ema: the average of each parameter, as of the step in `last_step` for each row.
    last_step: per parameter, int32 `(shape[0],)`: the step each row's average is up to
      date at (a scalar's, `()`).
  """

  step: jax.Array
  decay: jax.Array
  ema: optax.Params
  last_step: optax.Params


def _check_decay(decay: float) -> None:
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"Invalid decay value: {decay}; expected 0 <= decay < 1.")


def sparse_param_ema(decay: float) -> optax.GradientTransformationExtraArgs:
  r"""Keeps an exponential moving average of the parameters, touching only the stepped rows.

  Put it last in a chain, after the optimizer: it passes the updates on unchanged and
  averages the parameters they produce. Read the average with `ema_params`.

  .. math::

    \bar\theta_t = \delta\,\bar\theta_{t-1} + (1 - \delta)\,\theta_t,
    \qquad \bar\theta_0 = \theta_0

  A row not stepped for `k` steps keeps its parameter :math:`\theta`, so its average
  after them is :math:`\theta + \delta^k(\bar\theta - \theta)`: it is brought up to date
  when it is next stepped, and by `ema_params`. A step costs the rows it touches (BCOO
  updates) or the leaf (dense updates), never the table.

  Args:
    decay: the decay :math:`\delta`, in `[0, 1)`.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `ParamEMAState`; its
    `update` needs `params` (those before the step, as optax passes them).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = optax.chain(osa.sparse_adam(0.5), osa.sparse_param_ema(0.5))
    >>> params = {"table": jnp.zeros((4, 1))}
    >>> state = opt.init(params)
    >>> grads = {"table": sparse.BCOO((jnp.ones((1, 1)), jnp.array([[2]])), shape=(4, 1))}
    >>> updates, state = opt.update(grads, state, params)
    >>> params = osa.apply_updates(params, updates)
    >>> [round(x, 4) for x in osa.ema_params(state, params)["table"][:, 0].tolist()]
    [0.0, 0.0, -0.25, 0.0]

  References:
    Polyak and Juditsky, `Acceleration of stochastic approximation by averaging
    <https://doi.org/10.1137/0330046>`_, 1992.
  """
  _check_decay(decay)

  def init_fn(params: optax.Params) -> ParamEMAState:
    # A copy: the state's buffers must not be the params' (a step donates one, not both).
    ema = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
    last_step = jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p)[:1], jnp.int32), params, is_leaf=lambda x: x is None
    )
    return ParamEMAState(jnp.zeros((), jnp.int32), jnp.float32(decay), ema, last_step)

  # Unannotated, as optax's own update functions: the returned transformation is the typed API.
  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(
        "sparse_param_ema averages the parameters: pass params to update(updates, state, params)."
      )
    count = optax.safe_increment(state.step)
    leaves_with_path, treedef = flatten_grads(updates)
    param_leaves = leaves_up_to(treedef, params, "params")
    ema_leaves = leaves_up_to(treedef, state.ema, "sparse_param_ema's state")
    last_leaves = leaves_up_to(treedef, state.last_step, "sparse_param_ema's state")
    new_ema, new_last = [], []
    for (path, update), param, ema, last in zip(
      leaves_with_path, param_leaves, ema_leaves, last_leaves, strict=True
    ):
      if update is None or param is None:
        new_ema.append(ema)
        new_last.append(last)
        continue
      param = jnp.asarray(param)
      if isinstance(update, sparse.BCOO):
        e, s = _step_rows(update, param, ema, last, count, decay, path)
      else:
        e, s = _step_dense(update, param, ema, last, count, decay)
      new_ema.append(e)
      new_last.append(s)
    return updates, ParamEMAState(
      count, state.decay, treedef.unflatten(new_ema), treedef.unflatten(new_last)
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _caught_up(param: jax.Array, ema: jax.Array, idle: jax.Array, decay: Any) -> jax.Array:
  """The average after `idle` steps at a constant `param` (per row; `idle` broadcasts)."""
  shape = idle.shape + (1,) * (param.ndim - idle.ndim)
  factor = jnp.power(jnp.asarray(decay, jnp.float32), idle.astype(jnp.float32)).reshape(shape)
  caught = param + factor.astype(param.dtype) * (ema - param)
  # Up to date already: kept exactly (param + 1 * (ema - param) need not be ema).
  return jnp.where((idle == 0).reshape(shape), ema, caught).astype(ema.dtype)


def _blend(ema: jax.Array, param: jax.Array, decay: Any) -> jax.Array:
  return (decay * ema + (1.0 - decay) * param).astype(ema.dtype)


def _step_rows(update, param, ema, last, count, decay, path):
  layout = bcoo.row_layout(update, param.shape, path, what="update")
  if layout.sparse_shape != param.shape[:1]:
    raise ValueError(
      f"sparse_param_ema: the update at {path_str(path)} has n_sparse={update.n_sparse}; "
      "it averages whole rows (n_sparse=1). Convert it with "
      "jax.experimental.sparse.bcoo_update_layout(update, n_dense=update.ndim - 1)."
    )
  indices = row_update.checked_indices(update, path, what="update")
  # Duplicated rows are summed first, as apply_updates adds them: a row's new value is the
  # applied one. Padding rows are out of range: gathered as zeros, dropped when stored.
  summed = coalesce.coalesce_rows(bcoo.linear_rows(indices, layout), update.data, layout.num_rows)
  rows = summed.rows
  old_rows = param.at[rows].get(mode="fill", fill_value=0)
  if isinstance(update, SetRowsUpdate):  # a rule's new rows, stored as they are
    new_rows = summed.values.astype(param.dtype)
  else:
    new_rows = (old_rows + summed.values.astype(param.dtype)).astype(param.dtype)
  ema_rows = ema.at[rows].get(mode="fill", fill_value=0)
  idle = count - 1 - last.at[rows].get(mode="fill", fill_value=0)
  caught = _caught_up(old_rows, ema_rows, idle, decay)
  blended = _blend(caught, new_rows, decay)
  return (
    ema.at[rows].set(blended, mode="drop"),
    last.at[rows].set(count, mode="drop"),
  )


def _step_dense(update, param, ema, last, count, decay):
  new_param = jnp.asarray(param + update).astype(param.dtype)
  return _blend(ema, new_param, decay), jnp.full_like(last, count)


def ema_params(state: Any, params: optax.Params) -> optax.Params:
  """The parameters' moving average, every row brought up to date: for evaluation or serving.

  Args:
    state: a `ParamEMAState`, or an optimizer state holding one (a chain's, say): the
      first one found is read.
    params: the current parameters, of the structure given to `init`.

  Returns:
    The averaged parameters, each in its parameter's dtype. A row never stepped keeps its
    parameter exactly. Costs one pass over every parameter.
  """
  ema_state = _find_state(state)
  count = ema_state.step

  def leaf(path, param, ema, last):
    if param is None:
      return None
    param = jnp.asarray(param)
    if jnp.shape(ema) != param.shape:
      raise ValueError(
        f"ema_params: the parameter at {path_str(path)} has shape {param.shape} but its "
        f"average has {jnp.shape(ema)}; pass the params the state was made for."
      )
    return _caught_up(param, ema, count - last, ema_state.decay).astype(param.dtype)

  return jax.tree_util.tree_map_with_path(
    leaf, params, ema_state.ema, ema_state.last_step, is_leaf=lambda x: x is None
  )


def _find_state(state: Any) -> ParamEMAState:
  found = [
    s
    for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ParamEMAState))
    if isinstance(s, ParamEMAState)
  ]
  if not found:
    raise ValueError(
      "ema_params: no ParamEMAState in the given state; chain osa.sparse_param_ema(decay) "
      "after the optimizer and pass its state (or the chain's)."
    )
  return found[0]
