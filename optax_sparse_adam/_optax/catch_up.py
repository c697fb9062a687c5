"""Catch-up of idle rows in the optax layer: its checks, its state, and `catch_up_all_rows`.

Every factory registers its transformation here (`register`, with a
`Registered` that says how to read and write its state), so that
`catch_up_rows`/`catch_up_all_rows` take the step's own hyper-parameters and
the rule's own closed form (its `catch_up` hook, `_core/rules.CatchUp`):
the identity where idle rows do not move, a clear error where the rule has no
closed form. Adam's options are checked here when `sparse_adam` is made.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.errors import flatten_up_to, is_python_number, leaves_up_to
from optax_sparse_adam._core.row_rules import adam
from optax_sparse_adam._core.sharded import routed, sharding
from optax_sparse_adam._optax import leaf
from optax_sparse_adam._optax.state import SparseAdamState


class Registered(NamedTuple):
  """How `catch_up_rows` catches up one transformation's state.

  Attributes:
    name: the factory, in messages.
    rule: the transformation's rule.
    closed_form: the rule's `catch_up` hook for the transformation's `StepConfig`.
    keeps_last_steps: the state keeps `row_last_step` (`catch_up_idle_rows=True`
      and a closed form that moves rows).
    state_type: the class of the state its `init` makes.
    hyper: `count -> hyper-parameters` for the idle steps up to now (the window's rate).
    slots: `state -> {slot name: tree}`.
    replace: `(state, {slot name: tree}, row_last_step) -> state`.
  """

  name: str
  rule: Any
  closed_form: rules.CatchUp
  keeps_last_steps: bool
  state_type: type[Any]
  hyper: Callable[[jax.Array], Any]
  slots: Callable[[Any], dict[str, Any]]
  replace: Callable[[Any, dict[str, Any], Any], Any]


# Each transformation made by a factory, by its update function: `catch_up_rows`
# reads the hyper-parameters from here, so they cannot differ from the step's.
_REGISTERED: weakref.WeakKeyDictionary[Any, Registered] = weakref.WeakKeyDictionary()


def register(update_fn: Any, entry: Registered) -> None:
  """Remembers how to catch up the state of the transformation whose update is `update_fn`."""
  _REGISTERED[update_fn] = entry


def registered(optimizer: Any) -> Registered | None:
  """The entry of a transformation made by this package's factories, else None."""
  try:
    return _REGISTERED.get(getattr(optimizer, "update", None))
  except TypeError:  # not weak-referenceable: not ours
    return None


def refuse_unless_closed_form(name: str, rule: Any, closed_form: rules.CatchUp) -> None:
  """`catch_up_idle_rows=True` is refused, when made, for a rule without a closed form."""
  if closed_form.refused is not None:
    raise ValueError(
      f"{name}: catch_up_idle_rows=True is not available for the rule {rule.name!r}, "
      f"because {closed_form.refused}."
    )


def adam_entry(options: Any, config: rules.StepConfig) -> Registered:
  """The `Registered` of a `sparse_adam`/`sparse_adamw` transformation."""

  def hyper(count: jax.Array) -> adam.AdamHyperparams:
    learning_rate = window_learning_rate(options, count)
    if learning_rate is None:
      learning_rate = options.learning_rate
    coeffs = adam.adam_coefficients(
      learning_rate, options.b1, options.b2, options.eps, options.weight_decay
    )
    return adam.hyperparams_of(coeffs)

  def slots(state: Any) -> dict[str, Any]:
    return {"mu": state.mu, "nu": state.nu} | (
      {} if state.nu_max is None else {"nu_max": state.nu_max}
    )

  def replace(state: Any, new: dict[str, Any], row_last_step: Any) -> Any:
    return state._replace(**new, row_last_step=row_last_step)

  return Registered(
    "sparse_adamw" if options.decoupled_weight_decay else "sparse_adam",
    options.rule,
    rules.catch_up_of(options.rule, config),
    options.catch_up_idle_rows,
    SparseAdamState,
    hyper,
    slots,
    replace,
  )


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


def check_options(options: Any, config: rules.StepConfig) -> None:
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
  b1, b2 = (None, None) if options.amsgrad else known_betas(options.b1, options.b2)
  if b1 is not None and b2 is not None and b1 >= b2**0.5:
    raise ValueError(
      f"catch_up_idle_rows=True needs b1 < sqrt(b2) (got b1={b1}, b2={b2}, "
      f"sqrt(b2)={b2**0.5:.6g}): otherwise the catch-up's bound on the parameter grows "
      "with the idle steps (docs/catch_up.md). amsgrad=True catches up exactly for any "
      "betas."
    )
  if options.rowwise_second_moment:
    name = "sparse_adamw" if options.decoupled_weight_decay else "sparse_adam"
    refuse_unless_closed_form(name, options.rule, rules.catch_up_of(options.rule, config))


def known_betas(b1: Any, b2: Any) -> tuple[float, float]:
  """`b1` and `b2` as floats, to check `b1 < sqrt(b2)`; refuses a value traced in the step.

  Under `optax.inject_hyperparams` the betas reach the factory as arrays, traced
  inside a jitted update: their values are unknown there, so the catch-up's
  precondition could not be checked and a wrong pair would run unbounded.
  """
  traced = [name for name, x in (("b1", b1), ("b2", b2)) if isinstance(x, jax.core.Tracer)]
  if traced:
    raise ValueError(
      f"catch_up_idle_rows=True needs b1 and b2 known when the step is traced, to check "
      f"b1 < sqrt(b2) (docs/catch_up.md), but {' and '.join(traced)} "
      f"{'is' if len(traced) == 1 else 'are'} traced. Under optax.inject_hyperparams pass "
      "static_args=('b1', 'b2'), or use amsgrad=True (caught up exactly for any betas)."
    )
  return float(b1), float(b2)


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
  lazy Adam, until it is next touched, and is then caught up with the dense
  optimizer before its step. This takes those idle steps for every row at
  once, in the rule's closed form (its `catch_up` hook): for Adam, each row's
  moments become dense Adam's (:math:`m \mathrel{*}= \beta_1^k`,
  :math:`v \mathrel{*}= \beta_2^k` over its :math:`k` idle steps up to the
  parameter's step count) and the parameter moves by the same closed-form
  discharge (and AdamW decay) as in the step, with the learning rate of the
  last step; for SGD with momentum, the buffer decays by :math:`\mu^k` and the
  parameter moves by :math:`-\alpha b (\mu + \dots + \mu^k)` (torch's dense
  buffer). For rules whose idle rows do not move (SGD without momentum,
  Adagrad, row-wise Adagrad without weight decay) it returns `params` and
  `state` as they are, with or without `catch_up_idle_rows`. Call it before
  evaluating, exporting, or converting the state to a dense optimizer's. It
  reads and writes whole tables, O(table): it is never part of a step, and a
  step after it finds every row up to date.

  Args:
    optimizer: the transformation returned by `sparse_adam`, `sparse_adamw`,
      `sparse_sgd`, `sparse_adagrad`, `sparse_rowwise_adagrad` or
      `sparse_rule_transformation` (inside `optax.chain` or
      `optax.multi_transform`, that transformation and its own state).
    params: the parameters, the tree given to `init`.
    state: the optimizer's state (`SparseAdamState`, `SparseRuleState`).

  Returns:
    `(params, state)`, caught up; the step counts are unchanged.

  Raises:
    ValueError: the rule's idle rows move and `optimizer` was not made with
      `catch_up_idle_rows=True`; the rule has no closed form for them (the
      message names the rule and why); or `state` or `params` do not fit it.

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
  value before its idle steps, unless it was caught up first. The dense
  optimizer takes it after them. Call this on the batch's ids before the
  forward pass to read the rows as the dense optimizer has them (then the step
  finds them up to date); without it, the state is still the dense optimizer's
  for the gradients given.

  Args:
    optimizer: a transformation of this package (see `catch_up_all_rows`).
    params: the parameters, the tree given to `init`.
    state: the optimizer's state.
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
  entry = registered(optimizer)
  if entry is None:
    raise ValueError(
      f"{name} needs the transformation returned by sparse_adam, sparse_adamw, sparse_sgd, "
      "sparse_adagrad, sparse_rowwise_adagrad or sparse_rule_transformation (with "
      f"catch_up_idle_rows=True where the rule's idle rows move), got {optimizer!r}. "
      "Inside optax.chain or optax.multi_transform, pass that transformation and its own "
      "state."
    )
  rule = entry.rule
  if entry.closed_form.refused is not None:
    raise ValueError(
      f"{name}: the {entry.name} transformation's rule {rule.name!r} has no closed form of "
      f"its idle steps, because {entry.closed_form.refused}."
    )
  if not isinstance(state, entry.state_type):
    raise ValueError(
      f"{name} needs the {entry.state_type.__name__} that the optimizer's init made, got "
      f"{type(state).__name__}."
    )
  if entry.closed_form.rows is None:  # idle rows do not move: lazy is dense
    return params, state
  if not entry.keeps_last_steps or state.row_last_step is None:
    raise ValueError(
      f"{name}: the {entry.name} transformation was made without catch_up_idle_rows=True, "
      f"so its idle rows wait (lazy) and its state keeps no row_last_step; make it with "
      f"catch_up_idle_rows=True (and pass the {entry.state_type.__name__} its init makes)."
    )
  treedef: Any = jax.tree.structure(state.row_last_step)  # jaxlib ships no stub for PyTreeDef

  def leaves(tree: Any, what: str) -> list[Any]:
    return flatten_up_to(
      treedef,
      tree,
      lambda: (
        f"{name}: {what} must have the structure of the state's tables "
        f"({treedef}), got {jax.tree.structure(tree)}."
      ),
    )

  slot_trees = entry.slots(state)
  slot_leaves = {key: treedef.flatten_up_to(tree) for key, tree in slot_trees.items()}
  full_width = {slot.name for slot in rule.slots() if not slot.per_row}
  id_leaves = [_ALL] * treedef.num_leaves if ids is None else leaves(ids, "ids")
  hyper = entry.hyper(state.count)
  new: dict[str, list[Any]] = {"param": [], "last": []} | {key: [] for key in slot_trees}
  for i, (param, last, rows) in enumerate(
    zip(
      leaves(params, "params"),
      treedef.flatten_up_to(state.row_last_step),
      id_leaves,
      strict=True,
    )
  ):
    tables = {"param": param, "last": last} | {key: slot_leaves[key][i] for key in slot_trees}
    for key in full_width & set(slot_trees):
      if tuple(jnp.shape(param)) != tuple(tables[key].shape):
        raise ValueError(
          f"{name}: parameter {i} has shape {tuple(jnp.shape(param))} but its optimizer "
          f"state has shape {tuple(tables[key].shape)}: pass the params given to init."
        )
    if rows is None:
      for key in new:
        new[key].append(tables[key])
      continue
    if rows is not _ALL:
      num_rows = last.shape[0]
      rows = jnp.asarray(rows).reshape(-1)
      rows = jnp.where(rows < 0, num_rows, rows)  # negative ids are padding, not wrapped
      rows = routed.physical_ids(rows, param, name)  # a cyclic table's rows (sharded_routing)
      # Under Explicit mesh axes a gather from a row-split table has no one output
      # sharding: XLA partitions it, and every table keeps its own sharding.
      caught = sharding.call_with_auto_axes(
        functools.partial(_caught_up_rows, entry, hyper=hyper),
        (tables, rows, state.param_steps[i]),
        {key: sharding.spec_of(table) for key, table in tables.items()},
      )
    else:
      caught = _caught_up(entry, tables, state.param_steps[i], hyper)
    for key in new:
      new[key].append(caught[key])
  new_slots = {key: treedef.unflatten(new[key]) for key in slot_trees}
  new_state = entry.replace(state, new_slots, treedef.unflatten(new["last"]))
  return treedef.unflatten(new["param"]), new_state


def _caught_up_rows(
  entry: Registered, tables: dict[str, jax.Array], rows: jax.Array, step: jax.Array, hyper: Any
) -> dict[str, jax.Array]:
  """`tables` with `rows` (out of range: dropped) caught up to `step`."""
  got = {key: table.at[rows].get(mode="fill", fill_value=0) for key, table in tables.items()}
  return {
    key: tables[key].at[rows].set(value.astype(tables[key].dtype), mode="drop")
    for key, value in _caught_up(entry, got, step, hyper).items()
  }


def _caught_up(
  entry: Registered, rows: dict[str, jax.Array], step: jax.Array, hyper: Any
) -> dict[str, jax.Array]:
  """The rows (param, last, and the rule's slots) caught up to `step`."""
  param, last = rows["param"], rows["last"]
  slots = {key: value for key, value in rows.items() if key not in ("param", "last")}
  by_row = last.reshape(last.shape + (1,) * (jnp.ndim(param) - 1))
  compute_dtype = jnp.result_type(jnp.float32, param.dtype, *(s.dtype for s in slots.values()))
  assert entry.closed_form.rows is not None
  caught = entry.closed_form.rows(
    rules.IdleBlock(slots, jnp.maximum(step - by_row, 0), by_row, compute_dtype), hyper
  )
  move = caught.shift
  if caught.decay_minus_one is not None:
    move = move + caught.decay_minus_one * param.astype(compute_dtype)
  return {
    "param": (param.astype(compute_dtype) + move).astype(param.dtype),
    "last": jnp.maximum(last, step),  # every row's last step <= the step
  } | {key: caught.slot_rows[key] for key in slots}
