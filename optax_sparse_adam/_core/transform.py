"""Optax glue: `sparse_adam` and `sparse_adamw` transformations, and `apply_updates`."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse

from optax_sparse_adam._core import adam, bcoo, sharding
from optax_sparse_adam._core.errors import describe, path_str

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


def _is_leaf(x: Any) -> bool:
  return x is None or isinstance(x, sparse.BCOO)


def _is_python_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_scalar(value: Any) -> bool:
  """A real number, or a 0-d array of a real dtype (as `optax.inject_hyperparams` passes)."""
  if _is_python_number(value):
    return True
  dtype = getattr(value, "dtype", None)
  return (
    dtype is not None
    and getattr(value, "ndim", None) == 0
    and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
  )


def check_hyperparams(
  learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any = 0.0
) -> None:
  """torch's constructor checks, in torch's order and wording, for concrete numbers.

  Every hyper-parameter must be a real number or a 0-d real array; the values of
  arrays (as `optax.inject_hyperparams` passes) are not checked. Schedules are
  checked by the caller.
  """
  for name, value in (
    ("learning_rate", learning_rate),
    ("b1", b1),
    ("b2", b2),
    ("eps", eps),
    ("weight_decay", weight_decay),
  ):
    if not _is_scalar(value):
      raise TypeError(
        f"Invalid {name}: {value!r} ({describe(value)}); expected a float or a "
        "0-d real array" + (", or an optax.Schedule." if name == "learning_rate" else ".")
      )
  if _is_python_number(learning_rate) and not 0.0 < learning_rate:
    raise ValueError(f"Invalid learning rate: {learning_rate}")
  if _is_python_number(eps) and not 0.0 < eps:
    raise ValueError(f"Invalid epsilon value: {eps}")
  if _is_python_number(b1) and not 0.0 <= b1 < 1.0:
    raise ValueError(f"Invalid beta parameter at index 0: {b1}")
  if _is_python_number(b2) and not 0.0 <= b2 < 1.0:
    raise ValueError(f"Invalid beta parameter at index 1: {b2}")
  if _is_python_number(weight_decay) and not 0.0 <= weight_decay:
    raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _moment_dtype(dtype: Any, name: str) -> Any:
  """`dtype` as a NumPy dtype, refused unless it is a real floating dtype."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as err:
    raise TypeError(f"Invalid {name}: {dtype!r} is not a dtype.") from err
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"Invalid {name}: {dtype}; expected a real floating dtype such as float32.")
  return dtype


def _path_difference(
  paths: list[Any], tree: Any, what: str, *, first: str = "gradients", limit: int = 5
) -> str:
  """Names the leaf paths found in only one of `paths` (the `first`'s) and `tree`, if any."""
  grad_paths = [path_str(p) for p in paths]
  tree_paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  only_grads = [p for p in grad_paths if p not in set(tree_paths)][:limit]
  only_tree = [p for p in tree_paths if p not in set(grad_paths)][:limit]
  parts = []
  if only_grads:
    parts.append(f"only in the {first}: {', '.join(only_grads)}")
  if only_tree:
    parts.append(f"only in the {what}: {', '.join(only_tree)}")
  return f" ({'; '.join(parts)})" if parts else ""


def _leaves_up_to(treedef: Any, tree: Any, what: str, paths: list[Any] | None = None) -> list[Any]:
  """The leaves of `tree` at the gradient leaves' positions; refuses other structures.

  `flatten_up_to` accepts a subtree where the gradient has a leaf; that is a
  structure mismatch too, reported with the gradient leaf's path.
  """
  try:
    leaves = treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as err:
    raise ValueError(
      f"The gradient tree's structure differs from the {what}'s"
      f"{'' if paths is None else _path_difference(paths, tree, what)}. Gradients: "
      f"{treedef}; {what}: "
      f"{jax.tree_util.tree_structure(tree)}. Pass gradients with the structure of "
      "the params given to init."
    ) from err
  for path, leaf in zip(paths or [()] * len(leaves), leaves, strict=True):
    if leaf is not None and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(leaf)):
      raise ValueError(
        f"The gradient tree's structure differs from the {what}'s: the gradient "
        f"at {path_str(path)} is a single leaf, but the {what} holds a subtree "
        f"{jax.tree_util.tree_structure(leaf)} there. Pass gradients with the "
        "structure of the params given to init."
      )
  return leaves


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
  check_hyperparams(
    learning_rate if not callable(learning_rate) else 1.0, b1, b2, eps, weight_decay
  )
  mu_dtype = _moment_dtype(mu_dtype, "mu_dtype")
  nu_dtype = _moment_dtype(nu_dtype, "nu_dtype")

  def init_fn(params: optax.Params) -> SparseAdamState:
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

  def update_fn(
    updates: optax.Updates, state: SparseAdamState, params: optax.Params | None = None
  ) -> tuple[optax.Updates, SparseAdamState]:
    grads_with_path, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_leaf)
    paths = [path for path, _ in grads_with_path]
    step_leaves = _leaves_up_to(treedef, state.step, "optimizer state", paths)
    mu_leaves = _leaves_up_to(treedef, state.mu, "optimizer state", paths)
    nu_leaves = _leaves_up_to(treedef, state.nu, "optimizer state", paths)
    none = [None] * len(mu_leaves)
    nu_max_leaves = none if state.nu_max is None else treedef.flatten_up_to(state.nu_max)
    row_step_leaves = none if state.row_step is None else treedef.flatten_up_to(state.row_step)
    param_leaves = none if params is None else _leaves_up_to(treedef, params, "params", paths)

    # Validate every leaf before computing anything: a bad leaf fails the call whole.
    for (path, grad), mu, param in zip(grads_with_path, mu_leaves, param_leaves, strict=True):
      if grad is None:
        continue
      if not isinstance(grad, sparse.BCOO):
        raise TypeError(
          f"sparse_adam does not support dense gradients, please consider Adam "
          f"instead: the gradient at {path_str(path)} is dense "
          f"({describe(grad)}). Give it to optax.adam, or route dense and sparse "
          "leaves apart with optax.multi_transform({'sparse': sparse_adam(...), "
          "'dense': optax.adam(...)}, labels). If it is wrapped in "
          "optax.MultiSteps, which accumulates gradients densely, use "
          "optax_sparse_adam.sparse_multi_steps instead."
        )
      bcoo.row_layout(grad, mu.shape, path)
      if param is not None and tuple(jnp.shape(param)) != tuple(mu.shape):
        raise ValueError(
          f"Parameter at {path_str(path)} has shape {tuple(jnp.shape(param))} but "
          f"its optimizer state has shape {tuple(mu.shape)}: pass the params "
          "given to init (or re-init the state after reshaping them)."
        )

    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    # A zero the compiler cannot see through: the math rounds each product before
    # adding it, as torch does, instead of XLA contracting the pair into an FMA.
    opaque_zero = jnp.minimum(state.count, 0)
    coeffs = adam.adam_coefficients(lr, b1, b2, eps, weight_decay)
    new_updates, new = [], []
    for (path, grad), step, mu, nu, nu_max, row_step, param in zip(
      grads_with_path,
      step_leaves,
      mu_leaves,
      nu_leaves,
      nu_max_leaves,
      row_step_leaves,
      param_leaves,
      strict=True,
    ):
      leaf_state = adam.LeafState(step, mu, nu, nu_max, row_step)
      if grad is None:
        new_updates.append(None)
        new.append(leaf_state)
        continue
      update, leaf_state = adam.sparse_adam_leaf_step(
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
      # need both branches to match. The indices are sorted and unique regardless.
      update = sparse.BCOO(
        (update.data, update.indices),
        shape=update.shape,
        indices_sorted=grad.indices_sorted,
        unique_indices=grad.unique_indices,
      )
      new_updates.append(update)
      new.append(leaf_state)

    def field(name: str, old: Any) -> Any:
      if old is None:
        return None
      return treedef.unflatten([getattr(s, name) for s in new])

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


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
  """Applies updates to params: BCOO leaves by scatter-add, dense leaves as `optax.apply_updates`.

  A BCOO update is never densified: only its rows of the parameter are read and
  written. Inside `jax.jit` with the params donated this runs in place, in time
  proportional to the update's entries. A None update leaves its parameter as is.

  Args:
    params: a tree of parameters.
    updates: a tree of the same structure, with BCOO, array or None leaves.

  Returns:
    The updated parameters, each in its parameter's dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> u = sparse.BCOO((jnp.array([1.0, 2.0]), jnp.array([[0], [0]])), shape=(3,))
    >>> osa.apply_updates(jnp.zeros(3), u)
    Array([3., 0., 0.], dtype=float32)
  """

  def apply_leaf(path: Any, param: Any, update: Any) -> Any:
    if param is None or update is None:
      return param
    if isinstance(update, sparse.BCOO):
      bcoo.check_param_dtype(param, path)
      return bcoo.scatter_add_bcoo(jnp.asarray(param), update, path)
    param_shape, update_shape = jnp.shape(param), jnp.shape(update)
    try:
      fits = jnp.broadcast_shapes(param_shape, update_shape) == param_shape
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(
        f"apply_updates: the update at {path_str(path)} has shape {update_shape} "
        f"but its parameter has shape {param_shape}; expected the parameter's shape."
      )
    return jnp.asarray(param + update).astype(jnp.asarray(param).dtype)

  try:
    return jax.tree_util.tree_map_with_path(
      apply_leaf, params, updates, is_leaf=lambda x: x is None
    )
  except ValueError as err:
    if "tree structure" not in str(err) and "Custom node type mismatch" not in str(err):
      raise
    update_paths = [
      p for p, _ in jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_leaf)[0]
    ]
    raise ValueError(
      "apply_updates: the updates' tree structure differs from the params'"
      f"{_path_difference(update_paths, params, 'params', first='updates')}. "
      f"Params: {jax.tree_util.tree_structure(params)}; updates: "
      f"{jax.tree_util.tree_structure(updates, is_leaf=_is_leaf)}."
    ) from err
