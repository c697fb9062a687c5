"""Catch-up of idle rows in the optax layer: its checks, its state, and `catch_up_all_rows`.

`sparse_adam(..., catch_up_idle_rows=True)` checks its options here when it is
made and registers them, so that `catch_up_all_rows` reads the step's own
hyper-parameters; the row math is `_core.catch_up`'s.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._core import adam, catch_up
from optax_sparse_adam._core.errors import flatten_up_to, is_python_number, leaves_up_to
from optax_sparse_adam._optax import leaf

# The options of each transformation made with catch_up_idle_rows=True, by its
# update function: `catch_up_all_rows` reads the hyper-parameters from here, so
# they cannot differ from the step's.
_OPTIONS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register(update_fn: Any, options: Any) -> None:
  """Remembers a transformation's `SparseAdamOptions` if it catches up, for `catch_up_all_rows`."""
  if options.catch_up_idle_rows:
    _OPTIONS[update_fn] = options


def options_of(optimizer: Any) -> Any:
  """The options of a `sparse_adam`/`sparse_adamw` made with catch-up, else None."""
  try:
    return _OPTIONS.get(getattr(optimizer, "update", None))
  except TypeError:  # not weak-referenceable: not ours
    return None


def check_options(options: Any) -> None:
  """Refuses `catch_up_idle_rows=True` where it has no closed form or does not compose.

  Runs when the transformation is made, before any state exists.
  """
  if not options.catch_up_idle_rows:
    return
  if options.per_row_bias_correction:
    raise ValueError(
      "catch_up_idle_rows=True does not compose with per_row_bias_correction=True: "
      "catch-up takes dense Adam's steps, whose bias correction counts the parameter's "
      "steps, not each row's. Pass one of them."
    )
  if not options.decoupled_weight_decay and (
    leaf.weight_decay_mode(options.weight_decay, decoupled=False) != "none"
  ):
    raise ValueError(
      f"catch_up_idle_rows=True needs weight_decay=0 in sparse_adam (got "
      f"{options.weight_decay!r}): with L2 weight decay dense Adam's idle rows have the "
      "gradient weight_decay * p, whose steps have no closed form. Use sparse_adamw "
      "(decoupled weight decay, caught up as (1 - lr * weight_decay)^k)."
    )
  b1, b2 = options.b1, options.b2
  if not options.amsgrad and is_python_number(b1) and is_python_number(b2) and b1 >= b2**0.5:
    raise ValueError(
      f"catch_up_idle_rows=True needs b1 < sqrt(b2) (got b1={b1}, b2={b2}, "
      f"sqrt(b2)={b2**0.5:.6g}): otherwise the catch-up's bound on the parameter grows "
      "with the idle steps (docs/catch_up.md). amsgrad=True catches up exactly for any "
      "betas."
    )
  if not catch_up.supports(options.rule):
    raise ValueError(
      f"catch_up_idle_rows=True is not available for the rule {options.rule.name!r}."
    )


def last_step_leaves(
  treedef: Any, paths: list[Any], state: Any, wanted: bool
) -> list[jax.Array | None]:
  """Per gradient leaf, its rows' caught-up steps (None without catch-up); refuses misfits."""
  have = getattr(state, "row_last_step", None) is not None
  if wanted != have:
    raise ValueError(
      "The optimizer state "
      + ("lacks" if wanted else "has")
      + " row_last_step, but the transformation was made with catch_up_idle_rows="
      f"{wanted}: pass the state that this transformation's init made."
    )
  return leaves_up_to(treedef, state.row_last_step, "optimizer state", paths)


def catch_up_all_rows(
  optimizer: optax.GradientTransformation, params: optax.Params, state: optax.OptState
) -> tuple[optax.Params, optax.OptState]:
  r"""Brings every row up to date: the idle steps of `catch_up_idle_rows`, for all rows now.

  With `catch_up_idle_rows=True` a row skipped by the gradients waits, as in
  lazy Adam, until it is next touched, and is then caught up with dense Adam
  before its step. This takes those idle steps for every row at once: each
  row's moments become dense Adam's (:math:`m \mathrel{*}= \beta_1^k`,
  :math:`v \mathrel{*}= \beta_2^k` over its :math:`k` idle steps up to the
  parameter's step count) and the parameter moves by the same closed-form
  discharge (and AdamW decay) as in the step, with the learning rate of the
  last step. Call it before evaluating, exporting, or converting the state to a
  dense `optax.adam` state. It reads and writes whole tables, O(table): it is
  never part of a step, and a step after it finds every row up to date.

  Args:
    optimizer: the transformation returned by `sparse_adam` or `sparse_adamw`
      with `catch_up_idle_rows=True` (inside `optax.chain` or
      `optax.multi_transform`, that transformation and its own state).
    params: the parameters, the tree given to `init`.
    state: the optimizer's `SparseAdamState`.

  Returns:
    `(params, state)`, caught up; the step counts are unchanged.

  Raises:
    ValueError: `optimizer` was not made with `catch_up_idle_rows=True`, or
      `state` or `params` do not fit it.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_adam(0.1, catch_up_idle_rows=True)
    >>> params = jnp.zeros((3, 1))
    >>> state = opt.init(params)
    >>> for row in (0, 1, 1):
    ...   grad = sparse.BCOO((jnp.ones((1, 1)), jnp.array([[row]])), shape=(3, 1))
    ...   updates, state = opt.update(grad, state)
    ...   params = osa.apply_updates(params, updates)
    >>> params, state = osa.catch_up_all_rows(opt, params, state)
    >>> state.row_last_step
    Array([3, 3, 3], dtype=int32)
    >>> float(state.mu[0, 0]) == float(jnp.float32(0.1 * 0.9**2))
    True
  """
  options = options_of(optimizer)
  if options is None:
    raise ValueError(
      "catch_up_all_rows needs the transformation returned by sparse_adam or sparse_adamw "
      f"with catch_up_idle_rows=True, got {optimizer!r}. Inside optax.chain or "
      "optax.multi_transform, pass that transformation and its own state."
    )
  if getattr(state, "row_last_step", None) is None or not hasattr(state, "param_steps"):
    raise ValueError(
      "catch_up_all_rows needs the SparseAdamState that the optimizer's init made "
      f"(with row_last_step), got {type(state).__name__}."
    )
  treedef: Any = jax.tree.structure(state.mu)  # jaxlib ships no stub for PyTreeDef
  param_leaves = flatten_up_to(
    treedef,
    params,
    lambda: (
      f"catch_up_all_rows: params must have the structure of the state's moments "
      f"({treedef}), got {jax.tree.structure(params)}."
    ),
  )
  learning_rate = options.learning_rate
  if callable(learning_rate):
    learning_rate = learning_rate(jnp.maximum(state.count - 1, 0))
  coeffs = adam.adam_coefficients(
    learning_rate, options.b1, options.b2, options.eps, options.weight_decay
  )
  hyper = adam.hyperparams_of(coeffs)
  decoupled = (
    leaf.weight_decay_mode(options.weight_decay, decoupled=options.decoupled_weight_decay)
    == "decoupled"
  )
  rule = options.rule
  nu_max = (
    [None] * treedef.num_leaves if state.nu_max is None else treedef.flatten_up_to(state.nu_max)
  )
  new_params, new_mu, new_nu, new_last = [], [], [], []
  for i, (param, mu, nu, vmax, last) in enumerate(
    zip(
      param_leaves,
      treedef.flatten_up_to(state.mu),
      treedef.flatten_up_to(state.nu),
      nu_max,
      treedef.flatten_up_to(state.row_last_step),
      strict=True,
    )
  ):
    if tuple(jnp.shape(param)) != tuple(mu.shape):
      raise ValueError(
        f"catch_up_all_rows: parameter {i} has shape {tuple(jnp.shape(param))} but its "
        f"optimizer state has shape {tuple(mu.shape)}: pass the params given to init."
      )
    step = state.param_steps[i]
    by_row = last.reshape(last.shape + (1,) * (mu.ndim - 1))
    compute_dtype = jnp.result_type(jnp.float32, param.dtype, mu.dtype, nu.dtype)
    slots = {"mu": mu, "nu": nu} | ({} if vmax is None else {"nu_max": vmax})
    caught = catch_up.idle_rows(
      rule,
      slots,
      jnp.maximum(step - by_row, 0),
      by_row,
      hyper,
      decoupled=decoupled,
      compute_dtype=compute_dtype,
    )
    move = caught.shift
    if caught.decay_minus_one is not None:
      move = move + caught.decay_minus_one * param.astype(compute_dtype)
    new_params.append((param.astype(compute_dtype) + move).astype(param.dtype))
    new_mu.append(caught.slot_rows["mu"])
    new_nu.append(caught.slot_rows["nu"])
    new_last.append(jnp.maximum(last, step))  # every row's last step <= the step
  new_state = state._replace(
    mu=treedef.unflatten(new_mu),
    nu=treedef.unflatten(new_nu),
    row_last_step=treedef.unflatten(new_last),
  )
  return treedef.unflatten(new_params), new_state
