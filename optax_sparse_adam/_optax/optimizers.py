"""`sparse_sgd`, `sparse_adagrad`, `sparse_rowwise_adagrad`: over `sparse_rule_transformation`.

Each checks its options in torch's order and wording (or FBGEMM's names), picks
its rule from `_core/row_rules/` and hands both to the generic transformation.
Options whose torch semantics are dense on sparse gradients are refused with
what to use instead.
"""

from __future__ import annotations

from typing import Any

import optax

from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.hyperparams import check_nonnegative, known_number
from optax_sparse_adam._core.rounding import ParamRounding
from optax_sparse_adam._core.row_rules.adagrad import AdagradHyperparams, AdagradRule
from optax_sparse_adam._core.row_rules.ftrl import FtrlHyperparams, FtrlRule
from optax_sparse_adam._core.row_rules.rowwise_adagrad import (
  RowwiseAdagradHyperparams,
  RowwiseAdagradRule,
)
from optax_sparse_adam._core.row_rules.sgd import SGDHyperparams, SGDRule
from optax_sparse_adam._optax.rule_transform import sparse_rule_transformation
from optax_sparse_adam._optax.step_checks import DenseLeaves, NonzeroRefusal

ScalarOrSchedule = Any

SGD_WEIGHT_DECAY = (
  "weight_decay={wd!r} decays dense gradients only: torch.optim.SGD refuses weight decay "
  "with sparse gradients "
  "('add(sparse, dense) is not supported. Use add(dense, sparse) instead.'): its decay "
  "would move every row of the table each step. For a decay of the touched rows only, use "
  "sparse_rowwise_adagrad(weight_decay_mode=...) or sparse_adamw."
)
ADAGRAD_WEIGHT_DECAY = (
  "weight_decay={wd!r} decays dense gradients only: weight_decay option is "
  "not compatible with sparse gradients (torch.optim.Adagrad's words: its decay would "
  "move every row). For a decay of the touched rows only, use "
  "sparse_rowwise_adagrad(weight_decay_mode=...)."
)
SGD_MOMENTUM_UNBUFFERED = (
  "momentum={momentum!r}, but this sparse_sgd keeps no momentum buffer (it was made with "
  "momentum 0 and neither lazy_momentum nor catch_up_idle_rows), so the momentum would be "
  "ignored. To change the momentum later (optax.inject_hyperparams), make the optimizer with "
  "lazy_momentum=True or catch_up_idle_rows=True."
)
SGD_MOMENTUM = (
  "momentum={momentum!r}: torch.optim.SGD's momentum is not lazy on sparse gradients (dense "
  "gradients take it as they are): its "
  "buffer keeps every row it ever saw and moves all of them on every step. Pass "
  "catch_up_idle_rows=True for torch's numbers at sparse cost (an idle row takes those "
  "steps in closed form when it is next touched, or by catch_up_rows / catch_up_all_rows), "
  "or lazy_momentum=True for the row-wise form (a row's buffer decays and moves only when "
  "the row is touched; not torch's numbers)."
)


def _is_zero(value: Any) -> bool:
  """A Python zero (not an array: `optax.inject_hyperparams` gives arrays, concrete or not)."""
  return is_python_number(value) and value == 0


def _sparse_decay_refusal(message: str) -> NonzeroRefusal:
  """A traced weight decay that is nonzero when the step runs: refused on sparse leaves."""
  return NonzeroRefusal("weight_decay", lambda wd: message.format(wd=wd), sparse_leaves_only=True)


def _dense_leaves(weight_decay: Any, *refusals: str | None) -> DenseLeaves:
  """Dense leaves decay (L2) unless the rate is None or a Python zero; sparse leaves never
  do, and are refused with the first of `refusals` given (torch's refusals)."""
  decays = weight_decay is not None and not _is_zero(weight_decay)
  refusal = next((r for r in refusals if r is not None), None)
  return DenseLeaves("l2" if decays else "none", refusal)


def _unbuffered_momentum(momentum: float) -> str:
  return SGD_MOMENTUM_UNBUFFERED.format(momentum=momentum)


def sparse_sgd(
  learning_rate: ScalarOrSchedule = 1e-3,
  momentum: float = 0.0,
  dampening: float = 0.0,
  weight_decay: float = 0.0,
  nesterov: bool = False,
  *,
  maximize: bool = False,
  lazy_momentum: bool = False,
  catch_up_idle_rows: bool = False,
  track_changed_rows: bool = False,
  param_rounding: ParamRounding = "nearest",
) -> optax.GradientTransformationExtraArgs:
  r"""`torch.optim.SGD` for BCOO gradients (the touched rows move, nothing else) and dense ones.

  With :math:`g` the gradient after summing duplicate indices and :math:`r` its
  rows, :math:`\theta_r \leftarrow \theta_r - \alpha g_r` (ascending with
  `maximize`): torch's SGD on a sparse gradient, with no state.

  A dense gradient leaf (an array, not a BCOO) is stepped as torch.optim.SGD
  steps a dense gradient, every element, with all of its options: L2
  `weight_decay` (:math:`g + \lambda\theta`), `momentum`, `dampening`, `nesterov`
  (its update is dense; `apply_updates` takes both). So one `sparse_sgd` serves a
  whole model, embedding tables and MLPs alike, as one `torch.optim.SGD` does.

  torch refuses weight decay with sparse gradients: so does this, at `update`,
  naming the leaf. torch's momentum keeps a buffer that moves every row it ever
  saw, every step; on the touched rows

  .. math::
    b_r \leftarrow \mu b_r + (1 - d) g_r \ (b_r = g_r \text{ at the first step}), \quad
    \theta_r \leftarrow \theta_r - \alpha (g_r + \mu b_r \text{ if nesterov else } b_r)

  and an idle row moves by :math:`-\alpha b (\mu + \dots + \mu^k)` over
  :math:`k` steps (times :math:`\mu` with nesterov) while its buffer decays to
  :math:`\mu^k b`. Momentum with sparse gradients needs one of two flags:
  `catch_up_idle_rows=True`
  takes those idle steps in closed form when the row is next touched (or by
  `catch_up_rows` / `catch_up_all_rows`): torch's numbers, to float32 rounding,
  at sparse cost; `lazy_momentum=True` leaves idle rows and their buffers as
  they are (a row-wise momentum, not torch's numbers).

  Args:
    learning_rate: a float, or an `optax.Schedule` of the number of updates.
    momentum: the buffer's decay :math:`\mu` (for sparse gradients, needs
      `catch_up_idle_rows=True` or `lazy_momentum=True`; a Python number without
      them steps dense gradients only and refuses sparse ones at `update`).
    dampening: :math:`d`.
    weight_decay: L2 decay of dense gradients (needs `params` in `update`); a
      sparse gradient is refused unless it is 0 (as torch). Not with
      `catch_up_idle_rows=True`.
    nesterov: Nesterov momentum (needs momentum and zero dampening, as in torch).
    maximize: ascend the objective instead of descending it.
    lazy_momentum: allow `momentum > 0` in the row-wise (lazy) form above.
    catch_up_idle_rows: with momentum, torch's dense buffer at sparse cost (above;
      one int32 of state per row; a schedule's rate at the last idle step is
      charged to a row's idle steps, exact where the rate is constant over them).
      Without momentum (a Python 0) it changes nothing: an idle row does not move
      under dense SGD either (lazy is dense).
    track_changed_rows: keep each row's last written step (`row_last_step`), for
      `changed_rows`, `rows_delta` and `reset_rows` (docs/online.md).
    param_rounding: "nearest" or "stochastic" rounding of a 16-bit table's rows (docs/memory.md).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `SparseRuleState`
    (slot `momentum_buffer` with momentum, else none).

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> params = {"table": jnp.ones((4, 2))}
    >>> opt = osa.sparse_sgd(learning_rate=0.5)
    >>> grad = sparse.BCOO((jnp.ones((2, 2)), jnp.array([[1], [1]])), shape=(4, 2))
    >>> updates, _ = opt.update({"table": grad}, opt.init(params))
    >>> osa.apply_updates(params, updates)["table"][1]
    Array([0., 0.], dtype=float32)

  References:
    `torch.optim.SGD`, https://pytorch.org/docs/stable/generated/torch.optim.SGD.html
  """
  check_nonnegative(("lr", learning_rate), ("momentum", momentum), ("weight_decay", weight_decay))
  if nesterov and (known_number(momentum) == 0 or known_number(dampening) not in (0, None)):
    raise ValueError("Nesterov momentum requires a momentum and zero dampening")
  flagged = lazy_momentum or catch_up_idle_rows
  # A Python momentum without a flag: torch's buffer on dense gradients, sparse ones
  # refused at update; an array one (optax.inject_hyperparams) is refused here.
  dense_momentum = is_python_number(momentum) and momentum != 0 and not flagged
  if known_number(momentum) not in (0, None) and not (flagged or dense_momentum):
    raise ValueError(SGD_MOMENTUM.format(momentum=momentum))
  if lazy_momentum and catch_up_idle_rows:
    raise ValueError(
      "sparse_sgd: lazy_momentum=True and catch_up_idle_rows=True ask for two different "
      "momenta: lazy_momentum leaves idle rows where they are, catch_up_idle_rows moves "
      "them as torch.optim.SGD does. Pass one of them."
    )
  # The buffer by the flags, not the value, but for a Python zero: the state's structure
  # stays the same when optax.inject_hyperparams passes momentum as an array (with 0, the
  # buffer is g and nothing idle moves).
  buffered = lazy_momentum or dense_momentum or (catch_up_idle_rows and not _is_zero(momentum))
  refuse_decay = known_number(weight_decay) not in (0, None)
  return sparse_rule_transformation(
    SGDRule(momentum=buffered, nesterov=nesterov),
    SGDHyperparams(learning_rate, momentum, dampening, weight_decay),
    maximize=maximize,
    weight_decay_mode="none",  # sparse leaves; dense ones below
    catch_up_idle_rows=catch_up_idle_rows,
    track_changed_rows=track_changed_rows,
    param_rounding=param_rounding,
    dense_gradients=_dense_leaves(
      weight_decay,
      SGD_WEIGHT_DECAY.format(wd=weight_decay) if refuse_decay else None,
      SGD_MOMENTUM.format(momentum=momentum) if dense_momentum else None,
    ),
    nonzero_refusals=[_sparse_decay_refusal(SGD_WEIGHT_DECAY)]
    + ([] if buffered else [NonzeroRefusal("momentum", _unbuffered_momentum)]),
    name="sparse_sgd",
  )


def sparse_adagrad(
  learning_rate: ScalarOrSchedule = 1e-2,
  lr_decay: float = 0.0,
  weight_decay: float = 0.0,
  initial_accumulator_value: float = 0.0,
  eps: float = 1e-10,
  *,
  maximize: bool = False,
  catch_up_idle_rows: bool = False,
  track_changed_rows: bool = False,
  param_rounding: ParamRounding = "nearest",
) -> optax.GradientTransformationExtraArgs:
  r"""`torch.optim.Adagrad` for BCOO gradients (lazy, as torch is on them) and dense ones.

  With :math:`g` the gradient after summing duplicate indices (torch coalesces
  it), :math:`r` its rows and :math:`t` the parameter's step count,

  .. math::
    s_r &\leftarrow s_r + g_r^2 \\
    \theta_r &\leftarrow \theta_r - \frac{\alpha}{1 + (t - 1)\,\eta}
      \frac{g_r}{\sqrt{s_r} + \epsilon}

  and nothing else changes; :math:`s` starts at `initial_accumulator_value`.

  A dense gradient leaf (an array, not a BCOO) is stepped as torch.optim.Adagrad
  steps a dense gradient: the same formula on every element, with L2
  `weight_decay` (:math:`g + \lambda\theta` first), its update dense. So one
  `sparse_adagrad` serves a whole model, as one `torch.optim.Adagrad` does
  (`optax.adagrad` differs: its accumulator starts at 0.1 and its eps is inside
  the root).

  Args:
    learning_rate: :math:`\alpha`, a float or an `optax.Schedule`.
    lr_decay: :math:`\eta`.
    weight_decay: L2 decay of dense gradients (needs `params` in `update`); a
      sparse gradient is refused unless it is 0 (as torch). Not with
      `catch_up_idle_rows=True`.
    initial_accumulator_value: where :math:`s` starts.
    eps: added to :math:`\sqrt{s}`.
    maximize: ascend the objective instead of descending it.
    catch_up_idle_rows: accepted, and changes nothing: under dense Adagrad an idle
      row's gradient is zero, so neither its accumulator nor the row moves (lazy is
      dense).
    track_changed_rows: keep each row's last written step (`row_last_step`), for
      `changed_rows`, `rows_delta` and `reset_rows` (docs/online.md).
    param_rounding: "nearest" or "stochastic" rounding of a 16-bit table's rows (docs/memory.md).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `SparseRuleState`
    with one slot, `sum` (torch's `state['sum']`).

  Example:
    >>> import jax.numpy as jnp, optax_sparse_adam as osa
    >>> from jax.experimental.sparse import BCOO
    >>> opt = osa.sparse_adagrad(learning_rate=0.1)
    >>> grad = BCOO((jnp.full((1, 2), 3.0), jnp.array([[2]])), shape=(4, 2))
    >>> updates, state = opt.update({"t": grad}, opt.init({"t": jnp.zeros((4, 2))}))
    >>> updates["t"].data  # -lr * g / sqrt(g^2) at the first step
    Array([[-0.1, -0.1]], dtype=float32)

  References:
    `torch.optim.Adagrad`,
    https://pytorch.org/docs/stable/generated/torch.optim.Adagrad.html
  """
  check_nonnegative(
    ("lr", learning_rate),
    ("lr_decay", lr_decay),
    ("weight_decay", weight_decay),
    ("initial_accumulator_value", initial_accumulator_value),
    ("epsilon", eps),
  )
  refusal = None
  if known_number(weight_decay) not in (0, None):
    refusal = ADAGRAD_WEIGHT_DECAY.format(wd=weight_decay)
  # It fills the state at init: static (0 where optax.inject_hyperparams traces it in a
  # jitted update, which never reads it).
  initial = known_number(initial_accumulator_value)
  return sparse_rule_transformation(
    AdagradRule(initial_accumulator_value=float(initial or 0.0)),
    AdagradHyperparams(learning_rate, lr_decay, eps, weight_decay),
    maximize=maximize,
    weight_decay_mode="none",  # sparse leaves; dense ones below
    catch_up_idle_rows=catch_up_idle_rows,  # lazy Adagrad is dense Adagrad: no state
    track_changed_rows=track_changed_rows,
    param_rounding=param_rounding,
    dense_gradients=_dense_leaves(weight_decay, refusal),
    nonzero_refusals=[_sparse_decay_refusal(ADAGRAD_WEIGHT_DECAY)],
    name="sparse_adagrad",
  )


def sparse_rowwise_adagrad(
  learning_rate: ScalarOrSchedule = 1e-2,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  *,
  weight_decay_mode: str = "none",
  max_norm: float | None = None,
  maximize: bool = False,
  catch_up_idle_rows: bool = False,
  track_changed_rows: bool = False,
  param_rounding: ParamRounding = "nearest",
) -> optax.GradientTransformationExtraArgs:
  r"""FBGEMM's EXACT_ROWWISE_ADAGRAD for BCOO gradients: one accumulator per row.

  With :math:`g` the gradient after summing duplicate indices, :math:`r` its
  rows and :math:`D` the row's number of values,

  .. math::
    s_r &\leftarrow s_r + \tfrac{1}{D} \textstyle\sum_D g_r^2 \\
    \theta_r &\leftarrow \theta_r - \frac{\alpha}{\sqrt{s_r} + \epsilon} g_r

  (TorchRec's most used table optimizer). The state is one float per row.

  Args:
    learning_rate: :math:`\alpha`, a float or an `optax.Schedule`.
    eps: added to :math:`\sqrt{s}` (outside the root, as FBGEMM).
    weight_decay: :math:`\lambda`, read as `weight_decay_mode` says.
    weight_decay_mode: "none" (FBGEMM's default NONE; a nonzero `weight_decay`
      is then refused, not ignored: name the mode you mean); "l2" (FBGEMM's L2
      mode: :math:`g \mathrel{+}= \lambda \theta` before the row mean); or
      "decoupled" (FBGEMM's DECOUPLE: :math:`\theta_r \mathrel{-}= \alpha
      \lambda \theta_r`). Touched rows only.
    max_norm: after the step, scale each touched row whose L2 norm exceeds it
      back to it (FBGEMM's `max_norm`); None: off. Needs `params` in `update`.
    maximize: ascend the objective instead of descending it.
    catch_up_idle_rows: accepted without weight decay, and changes nothing (an idle
      row neither moves nor adds to its accumulator under the dense optimizer);
      refused with weight decay, which moves idle rows (no closed form here). Not
      with `max_norm`.
    track_changed_rows: keep each row's last written step (`row_last_step`), for
      `changed_rows`, `rows_delta` and `reset_rows` (docs/online.md).
    param_rounding: "nearest" or "stochastic" rounding of a 16-bit table's rows (docs/memory.md).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `SparseRuleState`
    with one per-row slot, `sum` (FBGEMM's `momentum1`), shape `(num_rows,)`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_rowwise_adagrad(learning_rate=0.1, eps=0.0)
    >>> state = opt.init({"table": jnp.zeros((4, 2))})
    >>> grad = sparse.BCOO((jnp.array([[3.0, 4.0]]), jnp.array([[0]])), shape=(4, 2))
    >>> state = opt.update({"table": grad}, state)[1]
    >>> state.slots["sum"]["table"]  # row 0: the mean of 3^2 and 4^2
    Array([12.5,  0. ,  0. ,  0. ], dtype=float32)

  References:
    FBGEMM, `fbgemm_gpu/codegen/genscript/optimizers.py` (`rowwise_adagrad`);
    `EmbOptimType.EXACT_ROWWISE_ADAGRAD` in TorchRec.
  """
  check_nonnegative(("lr", learning_rate), ("epsilon", eps), ("weight_decay", weight_decay))
  modes = ("none", "l2", "decoupled")
  if weight_decay_mode not in modes:
    raise ValueError(
      f"sparse_rowwise_adagrad: unknown weight_decay_mode {weight_decay_mode!r}; expected "
      f"one of {list(modes)} (FBGEMM's NONE, L2, DECOUPLE)"
    )
  return sparse_rule_transformation(
    RowwiseAdagradRule(),
    RowwiseAdagradHyperparams(learning_rate, eps, weight_decay),
    maximize=maximize,
    weight_decay_mode=weight_decay_mode,
    max_norm=max_norm,
    catch_up_idle_rows=catch_up_idle_rows,  # the rule refuses it under weight decay
    track_changed_rows=track_changed_rows,
    param_rounding=param_rounding,
    name="sparse_rowwise_adagrad",
  )


def sparse_ftrl(
  learning_rate: ScalarOrSchedule = 1e-3,
  learning_rate_power: float = -0.5,
  initial_accumulator_value: float = 0.1,
  l1_regularization_strength: float = 0.0,
  l2_regularization_strength: float = 0.0,
  l2_shrinkage_regularization_strength: float = 0.0,
  beta: float = 0.0,
  *,
  maximize: bool = False,
  param_rounding: ParamRounding = "nearest",
) -> optax.GradientTransformationExtraArgs:
  r"""FTRL-Proximal (`keras.optimizers.Ftrl`) for BCOO gradients: lazy, as TF's sparse step.

  With :math:`g` the gradient after summing duplicate indices, :math:`r` its
  rows, :math:`w` the parameter, :math:`p = -`learning_rate_power and
  :math:`\lambda_2' = \lambda_2 + \beta / (2\alpha)`, on the touched rows

  .. math::
    g' &= g_r + 2 \lambda_s w_r, \quad n' = n_r + g_r^2 \\
    z_r &\leftarrow z_r + g' - \frac{n'^p - n_r^p}{\alpha} w_r, \quad n_r \leftarrow n' \\
    w_r &\leftarrow \begin{cases} \frac{\mathrm{sign}(z_r) \lambda_1 - z_r}
      {n'^p / \alpha + 2 \lambda_2'} & |z_r| > \lambda_1 \\ 0 & \text{otherwise}
      \end{cases}

  (TF's `SparseApplyFtrlV2`) and nothing else changes. The update holds the
  rows' new values (a `SetRowsUpdate`), which `apply_updates` stores as they
  are: L1's zeros are exact zeros. Chain no transformation after it that
  changes its values (they are rows, not deltas).

  Args:
    learning_rate: :math:`\alpha`, a float or an `optax.Schedule`.
    learning_rate_power: :math:`-p`, at most 0 (-0.5: the square root).
    initial_accumulator_value: where :math:`n` starts, at least 0.
    l1_regularization_strength: :math:`\lambda_1`, at least 0.
    l2_regularization_strength: :math:`\lambda_2`, at least 0.
    l2_shrinkage_regularization_strength: :math:`\lambda_s`, at least 0: an L2
      penalty on the gradient only (the accumulator sees :math:`g`).
    beta: :math:`\beta`, added as :math:`\beta / (2\alpha)` to :math:`\lambda_2`.
    maximize: ascend the objective instead of descending it.
    param_rounding: how the new rows are rounded to a bfloat16 or float16 table:
      "nearest" (the default, a cast) or "stochastic" (unbiased, with bits
      hashed from the step, row and element; an exact zero stays zero). Changes
      nothing on a float32 table. See the Memory page of the docs.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `SparseRuleState`
    with two slots of the parameter's shape, `accumulator` and `linear`. Its
    `update` needs `params`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_ftrl(0.5, l1_regularization_strength=1.0)
    >>> params = {"table": jnp.ones((4, 2))}
    >>> grad = sparse.BCOO((jnp.array([[0.5, 3.0]]), jnp.array([[1]])), shape=(4, 2))
    >>> updates, state = opt.update({"table": grad}, opt.init(params), params)
    >>> osa.apply_updates(params, updates)["table"][1]  # column 0: |linear| <= l1, exactly 0
    Array([0.      , 0.232178], dtype=float32)

  References:
    McMahan et al., `Ad Click Prediction: a View from the Trenches`, KDD 2013;
    `keras.optimizers.Ftrl`, https://keras.io/api/optimizers/ftrl/
  """
  for name, value in (
    ("initial_accumulator_value", initial_accumulator_value),
    ("l1_regularization_strength", l1_regularization_strength),
    ("l2_regularization_strength", l2_regularization_strength),
    ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength),
  ):
    known = known_number(value)
    if known is not None and not known >= 0.0:
      raise ValueError(f"`{name}` needs to be positive or zero. Received: {name}={value}.")
  power = known_number(learning_rate_power)
  if power is not None and not power <= 0.0:
    raise ValueError(
      "`learning_rate_power` needs to be negative or zero. Received: "
      f"learning_rate_power={learning_rate_power}."
    )
  rate = known_number(learning_rate)
  if rate is not None and not rate > 0.0:
    raise ValueError(
      f"`learning_rate` needs to be positive (FTRL divides by it). Received: "
      f"learning_rate={learning_rate}."
    )
  # It fills the state at init: static (0.1 where optax.inject_hyperparams traces it in a
  # jitted update, which never reads it).
  initial = known_number(initial_accumulator_value)
  return sparse_rule_transformation(
    FtrlRule(initial_accumulator_value=float(0.1 if initial is None else initial)),
    FtrlHyperparams(
      learning_rate,
      learning_rate_power,
      l1_regularization_strength,
      l2_regularization_strength,
      l2_shrinkage_regularization_strength,
      beta,
      None,
    ),
    maximize=maximize,
    param_rounding=param_rounding,
    name="sparse_ftrl",
  )
