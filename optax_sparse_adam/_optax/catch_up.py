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

from optax_sparse_adam._core import catch_up
from optax_sparse_adam._core.errors import flatten_up_to, is_python_number, leaves_up_to
from optax_sparse_adam._core.row_rules import adam
from optax_sparse_adam._core.sharded import routed
from optax_sparse_adam._optax import leaf

# The options of each transformation made with catch_up_idle_rows=True, by its
# update function: `catch_up_all_rows` reads the hyper-parameters from here, so
# they cannot differ from the step's.
_OPTIONS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register(update_fn: Any, options: Any) -> None:
  """Remembers a transformation's `SparseAdamOptions` if it catches up, for `catch_up_all_rows`."""
  if options.catch_up_idle_rows:
    _OPTIONS[update_fn] = options


def window_learning_rate(options: Any, count: jax.Array) -> Any:
  """The rate charged to a row's idle steps by the step that counts `count` updates so far.

  A schedule's rate at `count - 1`, the step before: the last idle step of every
  row caught up now (its earlier idle steps are charged the same rate; the
  error is within the bound of `_core/catch_up.py` over the window's rates).
  `catch_up_rows` and the in-step catch-up both charge this, so a window gets
  the same rate whichever catches it up. None for a constant (or injected) rate:
  the step's own rate, the only one known.
  """
  if not options.catch_up_idle_rows or not callable(options.learning_rate):
    return None
  return options.learning_rate(jnp.maximum(count - 1, 0))


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
      + (
        ""
        if is_python_number(options.weight_decay)
        else " Under optax.inject_hyperparams, keep a zero a Python zero with "
        "static_args=('weight_decay',)."
      )
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
  return _catch_up("catch_up_all_rows", optimizer, params, state, None)


def catch_up_rows(
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  state: optax.OptState,
  ids: Any,
) -> tuple[optax.Params, optax.OptState]:
  """Brings the rows `ids` up to date (see `catch_up_all_rows`): O(ids), for the forward pass.

  A catch-up step takes a row's gradient where the forward pass read it: at its
  value before its idle steps, unless it was caught up first. Dense Adam takes
  it after them. Call this on the batch's ids before the forward pass to read
  the rows as dense Adam has them (then the step finds them up to date);
  without it, the moments are still dense Adam's for the gradients given.

  Args:
    optimizer: the transformation returned by `sparse_adam` or `sparse_adamw`
      with `catch_up_idle_rows=True`.
    params: the parameters, the tree given to `init`.
    state: the optimizer's `SparseAdamState`.
    ids: a tree like `params` (a prefix of it) with an int array of row ids of
      the leading dim per table, or None for a table to leave; repeated ids are
      fine, out-of-range and negative ones are ignored (BCOO padding).

  Returns:
    `(params, state)` with those rows caught up; the step counts are unchanged.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_adam(0.1, catch_up_idle_rows=True)
    >>> params = {"table": jnp.zeros((4, 2))}
    >>> state = opt.init(params)
    >>> grad = {"table": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))}
    >>> for _ in range(2):
    ...   updates, state = opt.update(grad, state)
    ...   params = osa.apply_updates(params, updates)
    >>> ids = {"table": jnp.array([0, 0, 9])}  # a batch's ids; 9 is padding
    >>> params, state = osa.catch_up_rows(opt, params, state, ids)
    >>> state.row_last_step["table"]
    Array([2, 2, 0, 0], dtype=int32)
  """
  return _catch_up("catch_up_rows", optimizer, params, state, ids)


_ALL = object()  # every row of a table


def _catch_up(
  name: str, optimizer: Any, params: Any, state: Any, ids: Any
) -> tuple[optax.Params, optax.OptState]:
  options = options_of(optimizer)
  if options is None:
    raise ValueError(
      f"{name} needs the transformation returned by sparse_adam or sparse_adamw "
      f"with catch_up_idle_rows=True, got {optimizer!r}. Inside optax.chain or "
      "optax.multi_transform, pass that transformation and its own state."
    )
  if getattr(state, "row_last_step", None) is None or not hasattr(state, "param_steps"):
    raise ValueError(
      f"{name} needs the SparseAdamState that the optimizer's init made "
      f"(with row_last_step), got {type(state).__name__}."
    )
  treedef: Any = jax.tree.structure(state.mu)  # jaxlib ships no stub for PyTreeDef

  def leaves(tree: Any, what: str) -> list[Any]:
    return flatten_up_to(
      treedef,
      tree,
      lambda: (
        f"{name}: {what} must have the structure of the state's moments "
        f"({treedef}), got {jax.tree.structure(tree)}."
      ),
    )

  param_leaves = leaves(params, "params")
  id_leaves = [_ALL] * treedef.num_leaves if ids is None else leaves(ids, "ids")
  learning_rate = window_learning_rate(options, state.count)
  if learning_rate is None:
    learning_rate = options.learning_rate
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
  new: dict[str, list[Any]] = {"param": [], "mu": [], "nu": [], "last": []}
  for i, (param, mu, nu, vmax, last, rows) in enumerate(
    zip(
      param_leaves,
      treedef.flatten_up_to(state.mu),
      treedef.flatten_up_to(state.nu),
      nu_max,
      treedef.flatten_up_to(state.row_last_step),
      id_leaves,
      strict=True,
    )
  ):
    if tuple(jnp.shape(param)) != tuple(mu.shape):
      raise ValueError(
        f"{name}: parameter {i} has shape {tuple(jnp.shape(param))} but its "
        f"optimizer state has shape {tuple(mu.shape)}: pass the params given to init."
      )
    tables = {"param": param, "mu": mu, "nu": nu, "last": last}
    if rows is None:
      for key in new:
        new[key].append(tables[key])
      continue
    if vmax is not None:
      tables["nu_max"] = vmax
    if rows is not _ALL:
      rows = jnp.asarray(rows).reshape(-1)
      rows = jnp.where(rows < 0, mu.shape[0], rows)  # negative ids are padding, not wrapped
      rows = routed.physical_ids(rows, mu, name)  # a cyclic table's rows (sharded_routing)
      got = {key: table.at[rows].get(mode="fill", fill_value=0) for key, table in tables.items()}
    else:
      got = tables
    caught = _caught_up(rule, got, state.param_steps[i], hyper, decoupled)
    if rows is not _ALL:
      caught = {
        key: tables[key].at[rows].set(value.astype(tables[key].dtype), mode="drop")
        for key, value in caught.items()
      }
    for key in new:
      new[key].append(caught[key])
  new_state = state._replace(
    mu=treedef.unflatten(new["mu"]),
    nu=treedef.unflatten(new["nu"]),
    row_last_step=treedef.unflatten(new["last"]),
  )
  return treedef.unflatten(new["param"]), new_state


def _caught_up(
  rule: Any, rows: dict[str, jax.Array], step: jax.Array, hyper: Any, decoupled: bool
) -> dict[str, jax.Array]:
  """The rows (param, mu, nu, last, and nu_max) caught up to `step`."""
  param, mu, nu, last = rows["param"], rows["mu"], rows["nu"], rows["last"]
  by_row = last.reshape(last.shape + (1,) * (mu.ndim - 1))
  compute_dtype = jnp.result_type(jnp.float32, param.dtype, mu.dtype, nu.dtype)
  slots = {"mu": mu, "nu": nu} | ({"nu_max": rows["nu_max"]} if "nu_max" in rows else {})
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
  return {
    "param": (param.astype(compute_dtype) + move).astype(param.dtype),
    "mu": caught.slot_rows["mu"],
    "nu": caught.slot_rows["nu"],
    "last": jnp.maximum(last, step),  # every row's last step <= the step
  }
