"""Optax glue: the `sparse_adam` and `sparse_adamw` transformations and their state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse

from optax_sparse_adam._core import adam, bcoo, leaf, sharding
from optax_sparse_adam._core.errors import describe, flatten_grads, leaves_up_to, path_str
from optax_sparse_adam._core.hyperparams import check_hyperparams, moment_dtype

ScalarOrSchedule = float | jax.Array | optax.Schedule


class SparseAdamState(NamedTuple):
  """State of `sparse_adam`.

  Attributes:
    count: int32 number of `update` calls, the input of a learning-rate schedule.
    step: per parameter, int32 number of steps it has taken (torch's
      `state['step']`); a parameter whose gradient is None does not advance.
    mu: per parameter, the first moment (torch's `exp_avg`).
    nu: per parameter, the second moment (torch's `exp_avg_sq`).
    nu_max: per parameter, the running max of `nu` with `amsgrad=True`, else None.
    row_step: per parameter, int32 steps of each row with
      `per_row_bias_correction=True`, else None.
  """

  count: jax.Array
  step: optax.Updates
  mu: optax.Updates
  nu: optax.Updates
  nu_max: optax.Updates | None
  row_step: optax.Updates | None


def _init_state(
  params: optax.Params,
  *,
  mu_dtype: Any,
  nu_dtype: Any,
  amsgrad: bool,
  per_row_bias_correction: bool,
) -> SparseAdamState:
  """Zero moments (and max/row steps where asked) for every parameter; count and steps 0."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  states = []
  for path, param in leaves_with_path:
    bcoo.check_param_dtype(param, path)
    states.append(
      adam.init_leaf_state(
        param,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        amsgrad=amsgrad,
        per_row_bias_correction=per_row_bias_correction,
      )
    )

  def field(name: str) -> Any:
    values = [getattr(s, name) for s in states]
    if any(v is None for v in values):
      return None
    return jax.tree_util.tree_unflatten(treedef, values)

  return SparseAdamState(
    count=jnp.zeros(
      [], jnp.int32, device=sharding.replicated_like(*(leaf for _, leaf in leaves_with_path))
    ),
    step=field("step"),
    mu=field("mu"),
    nu=field("nu"),
    nu_max=field("nu_max"),
    row_step=field("row_step"),
  )


def _leaf_states(treedef: Any, paths: list[Any], state: SparseAdamState) -> list[adam.LeafState]:
  """One `LeafState` per gradient leaf, read from the state's fields."""
  step = leaves_up_to(treedef, state.step, "optimizer state", paths)
  mu = leaves_up_to(treedef, state.mu, "optimizer state", paths)
  nu = leaves_up_to(treedef, state.nu, "optimizer state", paths)
  nu_max = leaves_up_to(treedef, state.nu_max, "optimizer state", paths)
  row_step = leaves_up_to(treedef, state.row_step, "optimizer state", paths)
  return [adam.LeafState(*fields) for fields in zip(step, mu, nu, nu_max, row_step, strict=True)]


def _check_grads(
  grads_with_path: list[tuple[Any, Any]], states: list[adam.LeafState], params: list[Any]
) -> None:
  """Refuses a dense gradient, a BCOO of the wrong layout, or a param of another shape.

  Runs over every leaf before anything is computed, so a bad leaf fails the
  whole call and no state changes.
  """
  for (path, grad), state, param in zip(grads_with_path, states, params, strict=True):
    if grad is None:
      continue
    if not isinstance(grad, sparse.BCOO):
      raise TypeError(
        f"sparse_adam needs BCOO gradients, but the gradient at {path_str(path)} is "
        f"dense ({describe(grad)}). If it comes from jax.grad through a table lookup "
        "(table[ids]), differentiate with respect to the gathered rows instead and "
        "build the BCOO: rows = table[ids]; row_grads = jax.grad(loss_of_rows)(rows); "
        "grad = jax.experimental.sparse.BCOO((row_grads, ids[:, None]), "
        "shape=table.shape). With Flax, optax_sparse_adam.sparse_value_and_grad does "
        "this for osa.SparseEmbed / LinenSparseEmbed tables. If the parameter is not "
        "an embedding table, give it to optax.adam, or route dense and sparse leaves "
        "apart with optax.multi_transform({'sparse': sparse_adam(...), "
        "'dense': optax.adam(...)}, labels). If it is wrapped in optax.MultiSteps, "
        "which accumulates gradients densely, use optax_sparse_adam.sparse_multi_steps "
        "instead."
      )
    bcoo.row_layout(grad, state.mu.shape, path)
    if param is not None and tuple(jnp.shape(param)) != tuple(state.mu.shape):
      raise ValueError(
        f"Parameter at {path_str(path)} has shape {tuple(jnp.shape(param))} but "
        f"its optimizer state has shape {tuple(state.mu.shape)}: pass the params "
        "given to init (or re-init the state after reshaping them)."
      )


def _scale_by_sparse_adam(
  learning_rate: ScalarOrSchedule,
  b1: float,
  b2: float,
  eps: float,
  weight_decay: float,
  *,
  maximize: bool,
  amsgrad: bool,
  decoupled_weight_decay: bool,
  per_row_bias_correction: bool,
  mu_dtype: Any,
  nu_dtype: Any,
) -> optax.GradientTransformation:
  """The transformation behind `sparse_adam` and `sparse_adamw` (see `sparse_adam`).

  `update` reads each parameter's `LeafState`, checks every gradient leaf, then
  steps each parameter with a BCOO gradient (`leaf.sparse_adam_leaf_step`); a
  None gradient leaves its parameter's state as it is.
  """
  check_hyperparams(
    learning_rate if not callable(learning_rate) else 1.0, b1, b2, eps, weight_decay
  )
  mu_dtype = moment_dtype(mu_dtype, "mu_dtype")
  nu_dtype = moment_dtype(nu_dtype, "nu_dtype")

  def init_fn(params: optax.Params) -> SparseAdamState:
    return _init_state(
      params,
      mu_dtype=mu_dtype,
      nu_dtype=nu_dtype,
      amsgrad=amsgrad,
      per_row_bias_correction=per_row_bias_correction,
    )

  def update_fn(
    updates: optax.Updates, state: SparseAdamState, params: optax.Params | None = None
  ) -> tuple[optax.Updates, SparseAdamState]:
    grads_with_path, treedef = flatten_grads(updates)
    paths = [path for path, _ in grads_with_path]
    states = _leaf_states(treedef, paths, state)
    param_leaves = leaves_up_to(treedef, params, "params", paths)
    _check_grads(grads_with_path, states, param_leaves)

    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    # A zero the compiler cannot see through: the math rounds each product before
    # adding it, as torch does, instead of XLA contracting the pair into an FMA.
    opaque_zero = jnp.minimum(state.count, 0)
    coeffs = adam.adam_coefficients(lr, b1, b2, eps, weight_decay)
    new_updates, new_states = [], []
    for (path, grad), leaf_state, param in zip(grads_with_path, states, param_leaves, strict=True):
      if grad is None:
        new_updates.append(None)
        new_states.append(leaf_state)
        continue
      update, leaf_state = leaf.sparse_adam_leaf_step(
        grad,
        leaf_state,
        param,
        coeffs,
        maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay,
        path=path,
        opaque_zero=opaque_zero,
      )
      # The update carries the gradient's BCOO metadata, so updates keep the
      # gradients' tree structure: lax.cond wrappers such as optax.apply_if_finite
      # need both branches to match. The indices are unique regardless, and sorted
      # but where a routed step leaves each device its own rows.
      new_updates.append(
        sparse.BCOO(
          (update.data, update.indices),
          shape=update.shape,
          indices_sorted=grad.indices_sorted and update.indices_sorted,
          unique_indices=grad.unique_indices,
        )
      )
      new_states.append(leaf_state)

    def field(name: str, old: Any) -> Any:
      if old is None:
        return None
      return treedef.unflatten([getattr(s, name) for s in new_states])

    new_state = SparseAdamState(
      count=optax.safe_increment(state.count),
      step=field("step", state.step),
      mu=field("mu", state.mu),
      nu=field("nu", state.nu),
      nu_max=field("nu_max", state.nu_max),
      row_step=field("row_step", state.row_step),
    )
    return treedef.unflatten(new_updates), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def sparse_adam(
  learning_rate: ScalarOrSchedule = 1e-3,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  *,
  maximize: bool = False,
  weight_decay: float = 0.0,
  amsgrad: bool = False,
  per_row_bias_correction: bool = False,
  mu_dtype: Any = None,
  nu_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""Masked Adam for BCOO gradients, with the numerics of `torch.optim.SparseAdam`.

  For each parameter whose gradient is a `jax.experimental.sparse.BCOO`, with
  :math:`g` the gradient after summing duplicate indices and :math:`r` the rows
  (entries) it touches, the parameter's own step counter :math:`t` advances by
  one and

  .. math::
    m_r &\leftarrow m_r + (1 - \beta_1)(g_r - m_r) \\
    v_r &\leftarrow v_r + (1 - \beta_2)(g_r^2 - v_r) \\
    \eta_t &= \alpha \sqrt{1 - \beta_2^t} / (1 - \beta_1^t) \\
    u_r &= -\eta_t \, m_r / (\sqrt{v_r} + \epsilon)

  Every other entry of :math:`m`, :math:`v` and the parameter is left exactly
  as it was. Note that :math:`\epsilon` is added to :math:`\sqrt{v}`, not to the
  bias-corrected :math:`\sqrt{\hat v}` as in `optax.adam`.

  The update for a BCOO gradient is a BCOO with sorted, unique indices holding
  the signed deltas, carrying the gradient's BCOO metadata (shape and flags) so
  that updates have the gradients' tree structure, as `lax.cond` wrappers such as
  `optax.apply_if_finite` require; apply it with
  `optax_sparse_adam.apply_updates`, which scatter-adds it
  (`optax.apply_updates` also works, but densifies). Inside
  `jax.jit`, donate the params and the state (`donate_argnums`), else XLA copies
  whole tables to scatter a few rows.

  Gradient entries with out-of-range indices are BCOO padding (what
  `BCOO.sum_duplicates(nse=...)` produces) and are ignored; so are negative
  indices. A leaf whose gradient is None is skipped and its step does not
  advance. Dense gradient leaves are refused: route them to a dense optimizer
  with `optax.multi_transform`.

  Args:
    learning_rate: a float, or an `optax.Schedule` of the number of updates.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to :math:`\sqrt{v}` in the denominator.
    maximize: ascend the objective instead of descending it.
    weight_decay: L2 penalty in the style of `torch.optim.Adam`: :math:`g_r
      \mathrel{+}= \lambda \theta_r`, on touched rows only, before the moments.
      Needs `params` in `update`. 0 (the default) keeps SparseAdam's numerics.
    amsgrad: use the running max of :math:`v` in the denominator (masked).
    per_row_bias_correction: give every row (every index of the sparse dims) its
      own step count, counted from its first touch, for the bias correction;
      costs one int32 per row of state.
    mu_dtype: dtype of the first moment; default the parameter's.
    nu_dtype: dtype of the second moment; default the parameter's.

  Returns:
    An `optax.GradientTransformation` whose state is a `SparseAdamState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> params = {"table": jnp.zeros((5, 2))}
    >>> opt = osa.sparse_adam(learning_rate=0.1)
    >>> state = opt.init(params)
    >>> grad = sparse.BCOO((jnp.ones((2, 2)), jnp.array([[3], [3]])), shape=(5, 2))
    >>> updates, state = opt.update({"table": grad}, state)
    >>> osa.apply_updates(params, updates)["table"][3]  # lr * sign(g) at the first step
    Array([-0.09999999, -0.09999999], dtype=float32)

  References:
    `torch.optim.SparseAdam`,
    https://pytorch.org/docs/stable/generated/torch.optim.SparseAdam.html

    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014
  """
  return _scale_by_sparse_adam(
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    maximize=maximize,
    amsgrad=amsgrad,
    decoupled_weight_decay=False,
    per_row_bias_correction=per_row_bias_correction,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
  )


def sparse_adamw(
  learning_rate: ScalarOrSchedule = 1e-3,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-2,
  *,
  maximize: bool = False,
  amsgrad: bool = False,
  per_row_bias_correction: bool = False,
  mu_dtype: Any = None,
  nu_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""`sparse_adam` with decoupled weight decay, applied to the touched rows only.

  .. math::
    u_r = -\eta_t \, m_r / (\sqrt{v_r} + \epsilon) - \alpha \lambda \theta_r

  Rows that the gradient does not touch are not decayed: decay is lazy, like
  the moments. A row seen every `k` steps thus decays `k` times less than under
  dense `optax.adamw`.

  Args:
    learning_rate: a float, or an `optax.Schedule` of the number of updates.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to :math:`\sqrt{v}` in the denominator.
    weight_decay: decoupled decay rate :math:`\lambda`. Needs `params` in `update`.
    maximize: ascend the objective instead of descending it.
    amsgrad: use the running max of :math:`v` in the denominator (masked).
    per_row_bias_correction: per-row step counts for the bias correction.
    mu_dtype: dtype of the first moment; default the parameter's.
    nu_dtype: dtype of the second moment; default the parameter's.

  Returns:
    An `optax.GradientTransformation` whose state is a `SparseAdamState`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> params = {"table": jnp.ones((5, 2))}
    >>> opt = osa.sparse_adamw(learning_rate=0.1, weight_decay=0.5)
    >>> grad = sparse.BCOO((jnp.ones((1, 2)), jnp.array([[3]])), shape=(5, 2))
    >>> updates, _ = opt.update({"table": grad}, opt.init(params), params)
    >>> osa.apply_updates(params, updates)["table"][3]
    Array([0.85, 0.85], dtype=float32)

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019
  """
  return _scale_by_sparse_adam(
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    maximize=maximize,
    amsgrad=amsgrad,
    decoupled_weight_decay=True,
    per_row_bias_correction=per_row_bias_correction,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
  )
