"""Optax glue: the `sparse_adam` and `sparse_adamw` transformations and their state."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, TypeAlias, TypedDict, Unpack

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._core import bcoo, rounding, rules
from optax_sparse_adam._core.errors import (
  flatten_grads,
  leaves_up_to,
)
from optax_sparse_adam._core.hyperparams import check_hyperparams, moment_dtype
from optax_sparse_adam._core.rounding import MomentRounding, ParamRounding
from optax_sparse_adam._core.row_rules import adam
from optax_sparse_adam._core.row_rules.adam import AdamRule
from optax_sparse_adam._core.row_rules.rowwise_adam import RowwiseAdamRule
from optax_sparse_adam._core.sharded import sharding
from optax_sparse_adam._optax import catch_up, leaf, online
from optax_sparse_adam._optax.rule_transform import advance_param_steps, step_leaves
from optax_sparse_adam._optax.state import (
  SparseAdamState,
  leaf_state_of,
  leaf_states,
  param_indices,
)
from optax_sparse_adam._optax.step_checks import check_grad_leaves, check_max_norm

ScalarOrSchedule: TypeAlias = float | jax.Array | optax.Schedule


class AdamFlags(TypedDict, total=False):
  """`sparse_adam`'s keyword-only flags that `sparse_adamw` takes too (`**flags`).

  Each is documented, with its default, in `sparse_adam`'s Args.
  """

  maximize: bool
  amsgrad: bool
  per_row_bias_correction: bool
  mu_dtype: Any
  nu_dtype: Any
  rowwise_second_moment: bool
  moment_rounding: MomentRounding
  param_rounding: ParamRounding
  catch_up_idle_rows: bool
  max_norm: float | None
  track_changed_rows: bool


class SparseAdamOptions(NamedTuple):
  """The options of `sparse_adam`/`sparse_adamw`, as one value (see `sparse_adam`)."""

  learning_rate: ScalarOrSchedule
  b1: float
  b2: float
  eps: float
  weight_decay: float
  maximize: bool
  amsgrad: bool
  decoupled_weight_decay: bool
  per_row_bias_correction: bool
  mu_dtype: Any
  nu_dtype: Any
  rowwise_second_moment: bool = False
  moment_rounding: MomentRounding = "nearest"
  catch_up_idle_rows: bool = False
  max_norm: float | None = None
  track_changed_rows: bool = False
  param_rounding: ParamRounding = "nearest"

  @property
  def rule(self) -> AdamRule | RowwiseAdamRule:
    if self.rowwise_second_moment:
      return RowwiseAdamRule(amsgrad=self.amsgrad)
    return AdamRule(amsgrad=self.amsgrad)


def _init_state(params: optax.Params, options: SparseAdamOptions) -> SparseAdamState:
  """Zero moments (and max/row steps where asked) for every parameter; count and steps 0."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  dtypes = {"mu": options.mu_dtype, "nu": options.nu_dtype}
  states = []
  last_steps = []
  for path, param in leaves_with_path:
    bcoo.check_param_dtype(param, path)
    rounding.check_slot_dtypes(options.moment_rounding, dtypes, param.dtype, path)
    rounding.check_param_rounding(options.param_rounding, param.dtype, path)
    tables = rules.init_tables(
      options.rule,
      param,
      dtypes=dtypes,
      per_row_steps=options.per_row_bias_correction,
      last_steps=options.catch_up_idle_rows or options.track_changed_rows,
    )
    step = jnp.zeros([], jnp.int32, device=sharding.replicated_like(param))
    states.append(leaf_state_of(step, tables))
    last_steps.append(tables.last_step)

  def field(name: str, wanted: bool = True) -> Any:
    # None by the flags, not by what init was given: on params without leaves
    # (optax.tree.map_params's placeholder) the field still says it follows them.
    if not wanted:
      return None
    return jax.tree_util.tree_unflatten(treedef, [getattr(s, name) for s in states])

  replicated = sharding.replicated_like(*(leaf for _, leaf in leaves_with_path))
  return SparseAdamState(
    count=jnp.zeros([], jnp.int32, device=replicated),
    param_steps=jnp.zeros([len(states)], jnp.int32, device=sharding.replicated_vector(replicated)),
    mu=field("mu"),
    nu=field("nu"),
    nu_max=field("nu_max", options.amsgrad),
    row_step=field("row_step", options.per_row_bias_correction),
    row_last_step=(
      jax.tree_util.tree_unflatten(treedef, last_steps)
      if options.catch_up_idle_rows or options.track_changed_rows
      else None
    ),
  )


def _scale_by_sparse_adam(options: SparseAdamOptions) -> optax.GradientTransformationExtraArgs:
  """The transformation behind `sparse_adam` and `sparse_adamw` (see `sparse_adam`).

  `update` reads each parameter's `LeafState`, checks every gradient leaf, then
  steps each parameter with a BCOO gradient under the Adam rule
  (`leaf.masked_leaf_step`); a None gradient leaves its parameter's state as it is.
  """
  learning_rate, b1, b2, eps, weight_decay = options[:5]
  check_hyperparams(
    learning_rate if not callable(learning_rate) else 1.0, b1, b2, eps, weight_decay
  )
  options = options._replace(
    mu_dtype=moment_dtype(options.mu_dtype, "mu_dtype"),
    nu_dtype=moment_dtype(options.nu_dtype, "nu_dtype"),
  )
  rounding.check_rounding(options.moment_rounding)
  rounding.check_rounding(options.param_rounding, "param_rounding")
  rule = options.rule
  config = rules.StepConfig(
    maximize=options.maximize,
    weight_decay=leaf.weight_decay_mode(weight_decay, decoupled=options.decoupled_weight_decay),
    moment_rounding=options.moment_rounding,
    max_norm=check_max_norm(options.max_norm, options.catch_up_idle_rows),
    param_rounding=options.param_rounding,
  )
  catch_up.check_options(options, config)
  name = "sparse_adamw" if options.decoupled_weight_decay else "sparse_adam"
  online.check_flag(options.track_changed_rows, name)

  def init_fn(params: optax.Params) -> SparseAdamState:
    return _init_state(params, options)

  def update_fn(
    updates: optax.Updates,
    state: SparseAdamState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, SparseAdamState]:
    del extra_args  # e.g. `value=` for a later optax.contrib.reduce_on_plateau
    grads_with_path, treedef = flatten_grads(updates)
    paths = [path for path, _ in grads_with_path]
    indices = param_indices(treedef, paths, state)
    states = leaf_states(treedef, paths, state, indices)
    param_leaves = leaves_up_to(treedef, params, "params", paths)
    shapes = [None if s.mu is None else tuple(s.mu.shape) for s in states]
    check_grad_leaves(grads_with_path, shapes, param_leaves)
    kept_last_steps = online.last_step_leaves(
      treedef,
      paths,
      state,
      catch_up_kept=options.catch_up_idle_rows,
      tracked=options.track_changed_rows,
      name=name,
    )
    # The backend catches rows up where it is given their last steps; tracking alone
    # marks the stepped rows after the step (online.new_last_steps).
    last_steps = kept_last_steps if options.catch_up_idle_rows else [None] * len(paths)

    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    # A zero the compiler cannot see through: the math rounds each product before
    # adding it, as torch does, instead of XLA contracting the pair into an FMA.
    opaque_zero = jnp.minimum(state.count, 0)
    hyper = adam.hyperparams_of(
      adam.adam_coefficients(lr, b1, b2, eps, weight_decay),
      window_learning_rate=catch_up.window_learning_rate(options, state.count),
    )
    tables = [
      rules.Tables(
        {slot.name: getattr(leaf_state, slot.name) for slot in rule.slots()},
        leaf_state.row_step,
        param,
        last_step,
      )
      for leaf_state, param, last_step in zip(states, param_leaves, last_steps, strict=True)
    ]
    new_updates, new_tables, new_steps = step_leaves(
      grads_with_path,
      tables,
      [leaf_state.step for leaf_state in states],
      rule=rule,
      config=config,
      hyper=hyper,
      opaque_zero=opaque_zero,
    )
    new_states = [
      leaf_state if grad is None else leaf_state_of(step, new)
      for (_, grad), leaf_state, step, new in zip(
        grads_with_path, states, new_steps, new_tables, strict=True
      )
    ]
    new_last_steps = online.new_last_steps(
      grads_with_path,
      kept_last_steps,
      [t.last_step for t in new_tables],
      new_updates,
      new_steps,
      marks=not options.catch_up_idle_rows,
    )

    def field(name: str, old: Any) -> Any:
      if old is None:
        return None
      return treedef.unflatten([getattr(s, name) for s in new_states])

    param_steps = advance_param_steps(state.param_steps, grads_with_path, indices)
    new_state = SparseAdamState(
      count=optax.safe_increment(state.count),
      param_steps=param_steps,
      mu=field("mu", state.mu),
      nu=field("nu", state.nu),
      nu_max=field("nu_max", state.nu_max),
      row_step=field("row_step", state.row_step),
      row_last_step=(
        None if state.row_last_step is None else jax.tree.unflatten(treedef, new_last_steps)
      ),
    )
    return treedef.unflatten(new_updates), new_state

  catch_up.register(update_fn, catch_up.adam_entry(options, config))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
  rowwise_second_moment: bool = False,
  moment_rounding: MomentRounding = "nearest",
  catch_up_idle_rows: bool = False,
  max_norm: float | None = None,
  track_changed_rows: bool = False,
  param_rounding: ParamRounding = "nearest",
) -> optax.GradientTransformationExtraArgs:
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
    rowwise_second_moment: keep one second moment per row, the mean of the
      row's :math:`g^2` averaged (FBGEMM's PARTIAL_ROWWISE_ADAM,
      `RowwiseAdamRule`; both moments bias-corrected, :math:`\epsilon` outside
      the corrected root). `nu` is then `(num_rows,)`; gradients must have
      `n_sparse=1`. Not torch's numerics: off by default.
    moment_rounding: how bf16 moments are stored: "nearest" (a cast; the
      default, so bf16 results stay as they were) or "stochastic" (unbiased,
      with bits hashed from the step, row and element: reproducible, and a
      resumed run continues the stream). To nearest, an update below half a
      bf16 ulp is lost every step, so slowly moving moments stall. See the
      Memory page of the docs.
    catch_up_idle_rows: take dense Adam's steps for the rows the gradients skip:
      a row touched after :math:`k` idle steps first has its moments decayed by
      :math:`\beta_1^k, \beta_2^k` and moves by the closed-form discharge of
      :math:`m` over them (docs/catch_up.md: where exact, the bound elsewhere);
      `catch_up_all_rows` does all rows. One int32 of state per row; needs
      `weight_decay=0` (use `sparse_adamw`), no `per_row_bias_correction`.
    max_norm: after the step, scale each touched row whose L2 norm exceeds it
      back to it (FBGEMM's per-row `max_norm`, here for Adam and the row-wise
      Adam); None (the default): off. Needs `params` in `update`; not with
      `catch_up_idle_rows`. Runs the XLA ops on the CPU (no fused kernel).
    track_changed_rows: keep each row's last written step (`row_last_step`,
      one int32 per row, shared with `catch_up_idle_rows`), for `changed_rows`,
      `rows_delta` and `reset_rows` (docs/online.md).
    param_rounding: how the parameter's new rows are rounded to a bfloat16 or
      float16 table: "nearest" (the default: the apply adds the update, as
      torch and a cast do) or "stochastic" (unbiased, with bits hashed from the
      step, row and element, a place in the stream of its own: a bf16 table
      then learns from updates below half its ulp). The update then holds the
      rounded rows, a `SetRowsUpdate` that `apply_updates` stores; needs
      `params` in `update`. Changes nothing on a float32 table. See the Memory
      page of the docs.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `SparseAdamState`;
    `update` ignores keyword arguments it does not use (such as `value=` for a
    later `optax.contrib.reduce_on_plateau`), as optax's optimizers do.

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
  return _scale_by_sparse_adam(SparseAdamOptions(**locals(), decoupled_weight_decay=False))


def sparse_adamw(
  learning_rate: ScalarOrSchedule = 1e-3,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-2,
  **flags: Unpack[AdamFlags],
) -> optax.GradientTransformationExtraArgs:
  r"""`sparse_adam` with decoupled weight decay, applied to the touched rows only.

  .. math::
    u_r = -\eta_t \, m_r / (\sqrt{v_r} + \epsilon) - \alpha \lambda \theta_r

  Rows that the gradient does not touch are not decayed: decay is lazy, like
  the moments. A row seen every `k` steps thus decays `k` times less than under
  dense `optax.adamw`, unless `catch_up_idle_rows=True`.

  Args:
    learning_rate: a float, or an `optax.Schedule` of the number of updates.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to :math:`\sqrt{v}` in the denominator.
    weight_decay: decoupled decay rate :math:`\lambda`. Needs `params` in `update`.
    **flags: `sparse_adam`'s keyword-only flags (`AdamFlags`), with its defaults:
      `maximize`, `amsgrad`, `per_row_bias_correction`, `mu_dtype`, `nu_dtype`,
      `rowwise_second_moment` (with it, `sparse_adamw` is FBGEMM's
      PARTIAL_ROWWISE_ADAM with its weight decay), `moment_rounding`,
      `catch_up_idle_rows` (dense AdamW's steps for the rows the gradients
      skip, the decoupled decay included: :math:`(1 - \alpha\lambda)^k` over
      :math:`k` idle steps), `max_norm`, `track_changed_rows` and `param_rounding`.

  Returns:
    As `sparse_adam`: an `optax.GradientTransformationExtraArgs` (extra keyword
    arguments of `update` are ignored) whose state is a `SparseAdamState`.

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
  unknown = sorted(set(flags) - AdamFlags.__optional_keys__)
  if unknown:
    raise TypeError(
      f"sparse_adamw() got unexpected keyword arguments {unknown}; its flags are "
      f"sparse_adam's: {sorted(AdamFlags.__optional_keys__)}"
    )
  options = _ADAM_SIGNATURE.bind(learning_rate, b1, b2, eps, weight_decay=weight_decay, **flags)
  options.apply_defaults()
  return _scale_by_sparse_adam(SparseAdamOptions(**options.arguments, decoupled_weight_decay=True))


def _adamw_signature() -> inspect.Signature:
  """`sparse_adam`'s signature with `weight_decay` fifth, positional, default 1e-2.

  What `inspect.signature(sparse_adamw)` reads, so that `optax.inject_hyperparams`
  sees each flag (as it does `sparse_adam`'s), not one `**flags` dict.
  """
  hyper: list[inspect.Parameter] = []
  keywords: list[inspect.Parameter] = []
  for parameter in _ADAM_SIGNATURE.parameters.values():
    if parameter.name == "weight_decay":
      hyper.append(parameter.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, default=1e-2))
    else:
      (keywords if parameter.kind is inspect.Parameter.KEYWORD_ONLY else hyper).append(parameter)
  return _ADAM_SIGNATURE.replace(parameters=hyper + keywords)


_ADAM_SIGNATURE = inspect.signature(sparse_adam)
sparse_adamw.__signature__ = _adamw_signature()  # type: ignore[attr-defined]
