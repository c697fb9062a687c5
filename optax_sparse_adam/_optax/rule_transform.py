"""The optax transformation of any row rule: one state layout, one update loop, one set of checks.

A rule module (`_core/row_rules/`) gives a `rules.RowRule` (slots and update)
and its hyper-parameters (a NamedTuple with `learning_rate` and
`weight_decay`). `sparse_rule_transformation` derives from them the optax
`GradientTransformation`: `init` makes the rule's slot tables for every
parameter, `update` checks every gradient leaf before anything changes,
evaluates schedules at the update count, and steps each parameter through
`leaf.masked_leaf_step` (every backend, row-sharded tables included). Its state
`SparseRuleState` depends only on the rule and the flags, never on the params
given to `init`, so `optax.tree.map_params` and `optax.inject_hyperparams` work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo, rounding, rules
from optax_sparse_adam._core.errors import flatten_grads, leaves_up_to
from optax_sparse_adam._core.hyperparams import moment_dtype
from optax_sparse_adam._core.sharded import sharding
from optax_sparse_adam._optax import catch_up, leaf, online, table_steps
from optax_sparse_adam._optax.state import check_param_steps
from optax_sparse_adam._optax.step_checks import (
  DenseLeaves,
  NonzeroRefusal,
  check_grad_leaves,
  check_max_norm,
  ignored_decay_message,
  refuse_ignored_decay,
  refuse_nonzero_when_run,
)


class SparseRuleState(NamedTuple):
  """State of `sparse_rule_transformation` (and of `sparse_sgd`, `sparse_adagrad`, ...).

  Attributes:
    count: int32 number of `update` calls, the input of schedules.
    param_steps: int32 `(num_params,)`, each parameter's step count (in the
      order of the params' leaves); a parameter whose gradient is None does not
      advance.
    slots: the rule's tables by slot name, each a tree like the params
      (a per-row slot's leaves are `(num_rows,)`).
    row_step: per parameter, int32 steps of each row with `per_row_steps=True`,
      else None.
    row_last_step: per parameter, int32 `(num_rows,)`, the step up to which each
      row is caught up with `catch_up_idle_rows=True` (where the rule's idle
      rows move), which is the step that last wrote it, as kept with
      `track_changed_rows=True`; else None.
  """

  count: jax.Array  # type: ignore[assignment]
  param_steps: jax.Array
  slots: dict[str, optax.Updates]
  row_step: optax.Updates | None = None
  row_last_step: optax.Updates | None = None


def advance_param_steps(
  param_steps: jax.Array, grads_with_path: list[tuple[Any, Any]], indices: list[int | None]
) -> jax.Array:
  """`param_steps` with the parameters stepped now advanced by one (saturating)."""
  stepped = np.zeros(param_steps.shape, bool)
  for (_, grad), index in zip(grads_with_path, indices, strict=True):
    if grad is not None and index is not None:
      stepped[index] = True
  return jnp.where(stepped, optax.safe_increment(param_steps), param_steps)


def step_leaves(
  grads_with_path: list[tuple[Any, Any]],
  tables: list[rules.Tables],
  steps: list[Any],
  *,
  rule: rules.RowRule,
  config: rules.StepConfig,
  hyper: Any,
  opaque_zero: jax.Array | None,
  dense_config: rules.StepConfig | None = None,
) -> tuple[list[Any], list[rules.Tables], list[Any]]:
  """Steps every parameter whose gradient is not None: `(updates, tables, steps)` per leaf.

  A None gradient leaves its parameter's tables and step as they are (update None);
  the BCOO gradients are stepped together (`table_steps.masked_leaf_steps`: on
  accelerators their tables share one sort); a dense gradient (checked by
  `check_grad_leaves`) steps every element under `dense_config`
  (`leaf.dense_leaf_step`) and its update is dense.
  """
  new_updates: list[Any] = []
  new_tables: list[rules.Tables] = []
  new_steps: list[Any] = []
  sparse_leaves: list[int] = []  # stepped together below (table_steps)
  for k, ((path, grad), leaf_tables, step) in enumerate(
    zip(grads_with_path, tables, steps, strict=True)
  ):
    if grad is None or isinstance(grad, sparse.BCOO):
      if grad is not None:
        sparse_leaves.append(k)
      new_updates.append(None)
      new_tables.append(leaf_tables)
      new_steps.append(step)
      continue
    assert dense_config is not None  # check_grad_leaves refused it otherwise
    dense_result = leaf.dense_leaf_step(
      grad,
      leaf_tables,
      step,
      rule=rule,
      config=dense_config,
      hyper=hyper,
      path=path,
      opaque_zero=opaque_zero,
    )
    new_updates.append(dense_result.update)
    new_tables.append(dense_result.tables)
    new_steps.append(dense_result.step)
  results = table_steps.masked_leaf_steps(
    [
      table_steps.SparseLeaf(
        grads_with_path[k][0],
        grads_with_path[k][1],
        tables[k],
        steps[k],
        # The update carries the gradient's BCOO metadata, so updates keep the gradients'
        # tree structure: lax.cond wrappers such as optax.apply_if_finite need both
        # branches to match.
        (grads_with_path[k][1].indices_sorted, grads_with_path[k][1].unique_indices),
      )
      for k in sparse_leaves
    ],
    rule=rule,
    config=config,
    hyper=hyper,
    opaque_zero=opaque_zero,
  )
  for k, result in zip(sparse_leaves, results, strict=True):
    new_updates[k], new_tables[k], new_steps[k] = result.update, result.tables, result.step
  return new_updates, new_tables, new_steps


def sparse_rule_transformation(
  rule: rules.RowRule,
  hyperparams: NamedTuple,
  *,
  maximize: bool = False,
  weight_decay_mode: str = "l2",
  slot_dtypes: dict[str, Any] | None = None,
  per_row_steps: bool = False,
  moment_rounding: rounding.MomentRounding = "nearest",
  param_rounding: rounding.ParamRounding = "nearest",
  max_norm: float | None = None,
  catch_up_idle_rows: bool = False,
  track_changed_rows: bool = False,
  dense_gradients: bool | DenseLeaves = False,
  nonzero_refusals: Sequence[NonzeroRefusal] = (),
  name: str = "sparse_rule_transformation",
) -> optax.GradientTransformationExtraArgs:
  r"""The optax transformation of a row rule, for BCOO gradients: masked, row by row.

  For each parameter whose gradient is a `jax.experimental.sparse.BCOO`, with
  :math:`g` the gradient after summing duplicate indices and :math:`r` the rows
  it touches, the parameter's step counter advances and

  .. math::
    g_r &\leftarrow -g_r \text{ if maximize}; \quad g_r \mathrel{+}= \lambda \theta_r
      \text{ (L2)} \\
    \Delta_r, s_r &\leftarrow \text{rule.update}(g_r, s_r, t) \\
    \Delta_r &\mathrel{-}= \alpha \lambda \theta_r \text{ (decoupled)}; \quad
      \theta_r + \Delta_r \text{ scaled to norm max\_norm where above}

  Every other row of the parameter and of the slots is left exactly as it was.
  The rule runs on every backend (the XLA ops, the accelerator step, row-sharded
  tables); a rule with a fused CPU kernel registered under its name runs it.

  Args:
    rule: a `RowRule` (a frozen dataclass with `name`, `slots()`, `update()`).
    hyperparams: the rule's hyper-parameters, a NamedTuple with at least
      `learning_rate` and `weight_decay`; each field a float, a 0-d array, or an
      `optax.Schedule` of the update count (evaluated at every update).
    maximize: ascend the objective instead of descending it.
    weight_decay_mode: "l2" (added to the gradient before the rule),
      "decoupled" (subtracted after it, times the learning rate), or "none"
      (then `weight_decay` must be 0 or None: a rate it would ignore is
      refused); a Python zero `weight_decay` (or None) means none and reads no
      parameter.
    slot_dtypes: a storage dtype by slot name (default: the parameter's).
    per_row_steps: give each row its own step count (`RowBlock.step`).
    moment_rounding: "nearest" or "stochastic", for bf16 slots.
    param_rounding: "nearest" (the apply adds the update) or "stochastic": the
      new rows of a bfloat16 or float16 table rounded up or down, unbiased
      (`_core/rounding.py`), returned as a `SetRowsUpdate` that `apply_updates`
      stores; needs `params` in `update`. Nothing changes on a float32 table.
    max_norm: renormalise each touched row to at most this L2 norm after the
      step (FBGEMM's `max_norm`); needs `params` in `update`.
    catch_up_idle_rows: take the dense optimizer's steps for the rows the
      gradients skip, in the rule's closed form (its `catch_up` hook): a row
      touched after `k` idle steps is caught up first (`catch_up_rows`,
      `catch_up_all_rows` do it on demand). Kept in one int32 per row where the
      rule's idle rows move; nothing where they do not (lazy is dense); refused,
      with the rule's reason, where it has no closed form.
    track_changed_rows: keep each row's last written step (`row_last_step`,
      one int32 per row, shared with catch-up), for `changed_rows`,
      `rows_delta` and `reset_rows` (docs/online.md).
    dense_gradients: also step dense gradient leaves: every row, under the same
      rule (the rule's row step on all rows; for an elementwise rule the dense
      optimizer's formula), their updates dense. False: refuse them, by path.
      A `DenseLeaves` value also sets their weight decay apart from the sparse
      leaves' (torch's SGD and Adagrad decay dense gradients only).
    nonzero_refusals: hyper-parameters the step would ignore, refused when
      nonzero: a traced one (`optax.inject_hyperparams` under `jit`) when the
      step runs. A traced `weight_decay` that `weight_decay_mode="none"` ignores
      is refused so without being named here.
    name: the factory's name in error messages.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `SparseRuleState`; apply its BCOO updates with `optax_sparse_adam.apply_updates`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> rule, hyper = osa.SGDRule(), osa.SGDHyperparams(learning_rate=0.5)
    >>> opt = osa.sparse_rule_transformation(rule, hyper)
    >>> params = {"table": jnp.zeros((4, 2))}
    >>> grad = sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))
    >>> updates, state = opt.update({"table": grad}, opt.init(params))
    >>> osa.apply_updates(params, updates)["table"][1]
    Array([-0.5, -0.5], dtype=float32)
  """
  if weight_decay_mode not in get_args(rules.WeightDecay):
    raise ValueError(
      f"{name}: unknown weight_decay_mode {weight_decay_mode!r}; expected one of "
      f"{list(get_args(rules.WeightDecay))}"
    )
  max_norm = check_max_norm(max_norm, catch_up_idle_rows, name=name)
  for field in ("learning_rate", "weight_decay"):
    if field not in getattr(hyperparams, "_fields", ()):
      raise TypeError(
        f"{name}: hyperparams must be a NamedTuple with a {field!r} field, got "
        f"{type(hyperparams).__name__}"
      )
  rounding.check_rounding(moment_rounding)
  rounding.check_rounding(param_rounding, "param_rounding")
  slot_names = [slot.name for slot in rule.slots()]
  dtypes = {}
  for slot_name, dtype in (slot_dtypes or {}).items():
    if slot_name not in slot_names:
      raise ValueError(
        f"{name}: slot_dtypes names {slot_name!r}, which the {rule.name!r} rule does not "
        f"keep; its slots are {slot_names}"
      )
    dtypes[slot_name] = moment_dtype(dtype, f"slot_dtypes[{slot_name!r}]")
  weight_decay = hyperparams.weight_decay  # type: ignore[attr-defined]
  # A transformation that decays dense leaves only (torch's SGD and Adagrad) refuses a
  # decay on sparse leaves itself, at update, naming the leaf.
  decays_dense_only = isinstance(
    dense_gradients, DenseLeaves
  ) and dense_gradients.weight_decay_mode not in (None, "none")
  if not decays_dense_only:
    refuse_ignored_decay(weight_decay, weight_decay_mode, name)
  refusals = list(nonzero_refusals)
  if weight_decay_mode == "none" and all(r.field != "weight_decay" for r in refusals):
    refusals.append(
      NonzeroRefusal("weight_decay", ignored_decay_message, sparse_leaves_only=decays_dense_only)
    )
  mode = "none"
  if weight_decay_mode != "none" and not callable(weight_decay):
    mode = leaf.weight_decay_mode(weight_decay, decoupled=weight_decay_mode == "decoupled")
  elif weight_decay_mode != "none":
    mode = weight_decay_mode
  config = rules.StepConfig(
    maximize=maximize,
    weight_decay=mode,  # type: ignore[arg-type]
    moment_rounding=moment_rounding,
    max_norm=max_norm,
    param_rounding=param_rounding,
  )
  dense: DenseLeaves | None = None
  dense_config = None
  if dense_gradients is not False:
    dense = dense_gradients if isinstance(dense_gradients, DenseLeaves) else DenseLeaves()
    dense_config = config
    if dense.weight_decay_mode is not None and dense.weight_decay_mode != config.weight_decay:
      dense_config = config._replace(weight_decay=dense.weight_decay_mode)  # type: ignore[arg-type]
      if catch_up_idle_rows and rules.catch_up_of(rule, dense_config).refused:
        raise ValueError(
          f"{name}: catch_up_idle_rows=True does not compose with weight decay, which "
          f"moves the dense gradients' rows ({rules.catch_up_of(rule, dense_config).refused}). "
          "Pass one of them."
        )
  closed_form = rules.catch_up_of(rule, config)
  if catch_up_idle_rows:
    catch_up.refuse_unless_closed_form(name, rule, closed_form)
  keeps_last_steps = catch_up_idle_rows and closed_form.rows is not None
  tracked = online.check_flag(track_changed_rows, name)

  def hyper_at(count: jax.Array) -> Any:
    # Schedules are functions of the update count, as in optax; with catch-up, a rule
    # that takes one charges its idle steps the rate of the step before (as Adam does).
    hyper = type(hyperparams)(*(v(count) if callable(v) else v for v in hyperparams))
    learning_rate = hyperparams.learning_rate  # type: ignore[attr-defined]
    if keeps_last_steps and callable(learning_rate) and "window_learning_rate" in hyper._fields:
      hyper = hyper._replace(window_learning_rate=learning_rate(jnp.maximum(count - 1, 0)))
    return hyper

  def init_fn(params: optax.Params) -> SparseRuleState:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    tables = []
    for path, param in leaves_with_path:
      bcoo.check_param_dtype(param, path)
      rounding.check_slot_dtypes(moment_rounding, dtypes, param.dtype, path)
      rounding.check_param_rounding(param_rounding, param.dtype, path)
      tables.append(
        rules.init_tables(
          rule,
          param,
          dtypes=dtypes,
          per_row_steps=per_row_steps,
          last_steps=keeps_last_steps or tracked,
        )
      )
    replicated = sharding.replicated_like(*(leaf for _, leaf in leaves_with_path))
    return SparseRuleState(
      count=jnp.zeros([], jnp.int32, device=replicated),
      param_steps=jnp.zeros(
        [len(tables)], jnp.int32, device=sharding.replicated_vector(replicated)
      ),
      # Keys by the rule, not by what init was given (optax.tree.map_params).
      slots={
        slot_name: jax.tree_util.tree_unflatten(treedef, [t.slots[slot_name] for t in tables])
        for slot_name in slot_names
      },
      row_step=jax.tree_util.tree_unflatten(treedef, [t.row_step for t in tables])
      if per_row_steps
      else None,
      row_last_step=jax.tree_util.tree_unflatten(treedef, [t.last_step for t in tables])
      if keeps_last_steps or tracked
      else None,
    )

  def update_fn(
    updates: optax.Updates,
    state: SparseRuleState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, SparseRuleState]:
    del extra_args
    grads_with_path, treedef = flatten_grads(updates)
    paths = [path for path, _ in grads_with_path]
    check_param_steps(
      state.param_steps,
      len(paths),
      "the gradients",
      " Pass the state that this transformation's init made for these params.",
    )
    if (state.row_step is None) == per_row_steps or set(state.slots) != set(slot_names):
      raise ValueError(
        f"{name}: the optimizer state has slots {sorted(state.slots)} and "
        f"{'no ' if state.row_step is None else ''}row steps, but the {rule.name!r} rule "
        f"keeps {sorted(slot_names)}{' and row steps' if per_row_steps else ''}: pass the "
        "state that this transformation's init made."
      )
    slot_leaves = {
      slot_name: leaves_up_to(treedef, tree, "optimizer state", paths)
      for slot_name, tree in state.slots.items()
    }
    row_steps = leaves_up_to(treedef, state.row_step, "optimizer state", paths)
    kept_last_steps = online.last_step_leaves(
      treedef, paths, state, catch_up_kept=keeps_last_steps, tracked=tracked, name=name
    )
    # The backend catches rows up where it is given their last steps; tracking alone
    # marks the stepped rows after the step (online.new_last_steps).
    last_steps = kept_last_steps if keeps_last_steps else [None] * len(paths)
    param_leaves = leaves_up_to(treedef, params, "params", paths)
    full_width = [slot.name for slot in rule.slots() if not slot.per_row]
    shapes = [
      tuple(slot_leaves[full_width[0]][i].shape) if full_width else None for i in range(len(paths))
    ]
    check_grad_leaves(grads_with_path, shapes, param_leaves, name, dense)

    hyper = hyper_at(state.count)
    grads_with_path = refuse_nonzero_when_run(refusals, hyper, grads_with_path, name)
    opaque_zero = jnp.minimum(state.count, 0)  # products rounded before adds (adam.rounded)
    tables = [
      rules.Tables({n: slot_leaves[n][i] for n in slot_names}, row_steps[i], param, last_steps[i])
      for i, param in enumerate(param_leaves)
    ]
    new_updates, new_tables, new_steps = step_leaves(
      grads_with_path,
      tables,
      [state.param_steps[i] for i in range(len(paths))],
      rule=rule,
      config=config,
      hyper=hyper,
      opaque_zero=opaque_zero,
      dense_config=dense_config,
    )

    indices: list[int | None] = list(range(len(paths)))
    new_state = SparseRuleState(
      count=optax.safe_increment(state.count),
      param_steps=advance_param_steps(state.param_steps, grads_with_path, indices),
      slots={n: treedef.unflatten([t.slots[n] for t in new_tables]) for n in slot_names},
      row_step=(
        None if state.row_step is None else treedef.unflatten([t.row_step for t in new_tables])
      ),
      row_last_step=(
        None
        if not (keeps_last_steps or tracked)
        else treedef.unflatten(
          online.new_last_steps(
            grads_with_path,
            kept_last_steps,
            [t.last_step for t in new_tables],
            new_updates,
            new_steps,
            marks=not keeps_last_steps,
          )
        )
      ),
    )
    return treedef.unflatten(new_updates), new_state

  catch_up.register(
    update_fn,
    catch_up.Registered(
      name,
      rule,
      closed_form,
      keeps_last_steps,
      SparseRuleState,
      hyper_at,
      lambda state: dict(state.slots),
      lambda state, slots, last: state._replace(slots=slots, row_last_step=last),
    ),
  )
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
