"""The checks every transformation runs before a step: its gradient leaves and its options.

`check_grad_leaves` runs over every leaf before anything is computed, so a bad leaf
fails the whole call and no state changes; `refuse_ignored_decay` and `check_max_norm`
run when a transformation is made; `refuse_nonzero_when_run` checks, when the step runs,
the traced values of hyper-parameters the step would ignore. Shared by
`sparse_rule_transformation` and `sparse_adam`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo
from optax_sparse_adam._core.errors import describe, path_str
from optax_sparse_adam._core.hyperparams import known_number
from optax_sparse_adam._core.row_update import padding_if

# Where a dense gradient goes instead, for the transformations that refuse them: the
# factory, and what the message says of it. Any other rule's message names optax's
# optimizers in general.
_DENSE_TWIN = {
  "sparse_adam": ("optax.adam", ""),
  "sparse_adamw": ("optax.adamw", ""),
  "sparse_rowwise_adagrad": (
    "optax_sparse_adam.sparse_adagrad",
    " (torch.optim.Adagrad's numbers, dense gradients included)",
  ),
}


class DenseLeaves(NamedTuple):
  """How a transformation that takes dense gradients steps them (`sparse_sgd`, `sparse_adagrad`).

  Attributes:
    weight_decay_mode: the dense leaves' weight decay ("none", "l2",
      "decoupled"; torch's, which it refuses on sparse gradients), or None: the
      sparse leaves'.
    sparse_refusal: a message refusing BCOO gradients (options the dense
      optimizer takes but torch refuses on sparse gradients), or None.
  """

  weight_decay_mode: str | None = None
  sparse_refusal: str | None = None


def check_grad_leaves(
  grads_with_path: list[tuple[Any, Any]],
  shapes: Sequence[tuple[int, ...] | None],
  params: list[Any],
  what: str = "sparse_adam",
  dense: DenseLeaves | None = None,
) -> None:
  """Refuses a dense gradient (unless `dense`), a BCOO of the wrong layout, or a param of
  another shape.

  `shapes[i]` is the shape the state keeps for leaf i (None: known from the
  gradient only). Runs over every leaf before anything is computed, so a bad
  leaf fails the whole call and no state changes.
  """
  twin, twin_note = _DENSE_TWIN.get(
    what, ("a dense optax optimizer", " (optax.adam, optax.sgd, ...)")
  )
  dense_call = f"{twin}(...)" if what in _DENSE_TWIN else "optax.adam(...)"
  for (path, grad), shape, param in zip(grads_with_path, shapes, params, strict=True):
    if grad is None:
      continue
    if not isinstance(grad, sparse.BCOO) and dense is not None:
      grad_shape = tuple(jnp.shape(grad))
      for known, whose in ((shape, "optimizer state"), (_shape_or_none(param), "parameter")):
        if known is not None and tuple(known) != grad_shape:
          raise ValueError(
            f"{what}: the dense gradient at {path_str(path)} has shape {grad_shape} but "
            f"its {whose} has shape {tuple(known)}; they must be equal."
          )
      continue
    if not isinstance(grad, sparse.BCOO):
      raise TypeError(
        f"{what} needs BCOO gradients, but the gradient at {path_str(path)} is "
        f"dense ({describe(grad)}). If it comes from jax.grad through a table lookup "
        "(table[ids]), differentiate with respect to the gathered rows instead and "
        "build the BCOO: rows = table[ids]; row_grads = jax.grad(loss_of_rows)(rows); "
        "grad = jax.experimental.sparse.BCOO((row_grads, ids[:, None]), "
        "shape=table.shape). With Flax, optax_sparse_adam.sparse_value_and_grad does "
        "this for osa.SparseEmbed / SparseEmbedBag / LinenSparseEmbed / "
        "LinenSparseEmbedBag tables. If the parameter is not an embedding table, give it "
        f"to {twin}{twin_note}, or route dense and sparse leaves apart with "
        f"optax.multi_transform({{'sparse': {what}(...), 'dense': {dense_call}}}, labels). "
        "If it is "
        "wrapped in optax.MultiSteps, which accumulates gradients densely, use "
        "optax_sparse_adam.sparse_multi_steps instead."
      )
    if dense is not None and dense.sparse_refusal is not None:
      raise ValueError(
        f"{what}: the gradient at {path_str(path)} is sparse (BCOO): " + (dense.sparse_refusal)
      )
    if shape is None:
      shape = tuple(grad.shape) if param is None else tuple(jnp.shape(param))
    bcoo.row_layout(grad, shape, path)
    if param is not None and tuple(jnp.shape(param)) != tuple(shape):
      raise ValueError(
        f"Parameter at {path_str(path)} has shape {tuple(jnp.shape(param))} but "
        f"its optimizer state has shape {tuple(shape)}: pass the params "
        "given to init (or re-init the state after reshaping them)."
      )


def _shape_or_none(param: Any) -> tuple[int, ...] | None:
  return None if param is None else tuple(jnp.shape(param))


def refuse_ignored_decay(weight_decay: Any, weight_decay_mode: str, name: str) -> None:
  """Refuses a weight decay that `weight_decay_mode="none"` would ignore without a word.

  A rate known now (a number, a concrete array) other than 0, or a schedule, is
  refused; a traced array is not known now, and is checked when the step runs
  (`NonzeroRefusal`).
  """
  if weight_decay_mode != "none" or weight_decay is None:
    return
  if callable(weight_decay) or known_number(weight_decay) not in (0, None):
    raise ValueError(f"{name}: {ignored_decay_message(weight_decay)}")


def ignored_decay_message(weight_decay: Any) -> str:
  """What `refuse_ignored_decay` says (and its run-time twin, for a traced rate)."""
  return (
    f"weight_decay={weight_decay!r} is given with weight_decay_mode='none', "
    "which would ignore it. Pass weight_decay_mode='l2' (the decay added to the "
    "gradient, g + weight_decay * p, before the rule: FBGEMM's L2) or 'decoupled' "
    "(p - learning_rate * weight_decay * p after it: FBGEMM's DECOUPLE), or "
    "weight_decay=0."
  )


class NonzeroRefusal(NamedTuple):
  """A hyper-parameter the step would ignore, so it must be 0: refused when nonzero.

  A value known when the transformation is made is refused then, by its factory. A
  traced one (`optax.inject_hyperparams` under `jit` passes every hyper-parameter
  traced, and lets the user change it in the state later) is checked when the step
  runs, by `refuse_nonzero_when_run`.

  Attributes:
    field: the hyper-parameters' field.
    message: the refusal, given the value.
    sparse_leaves_only: only sparse leaves ignore it (dense ones take it).
  """

  field: str
  message: Callable[[float], str]
  sparse_leaves_only: bool = False


def refuse_nonzero_when_run(
  refusals: Sequence[NonzeroRefusal],
  hyper: Any,
  grads_with_path: list[tuple[Any, Any]],
  what: str,
) -> list[tuple[Any, Any]]:
  """The gradients, guarded against the traced hyper-parameters the step would ignore.

  For each refusal whose value is traced and a leaf that would ignore it: when the
  step runs with the value nonzero, a host callback raises the refusal (naming the
  first such leaf), and those leaves' gradients become all padding (sparse) or zeros
  (dense), so nothing is stepped by the value ignored. Concrete values pass (their
  factory checked them).
  """
  guarded = list(grads_with_path)
  for refusal in refusals:
    value = getattr(hyper, refusal.field)
    if not isinstance(value, jax.core.Tracer):
      continue
    hit = [
      i
      for i, (_, grad) in enumerate(guarded)
      if grad is not None and (isinstance(grad, sparse.BCOO) or not refusal.sparse_leaves_only)
    ]
    if not hit:
      continue
    where = path_str(guarded[hit[0]][0])
    kind = "sparse (BCOO)" if isinstance(guarded[hit[0]][1], sparse.BCOO) else "dense"

    def raise_if_nonzero(
      v: Any, refusal: NonzeroRefusal = refusal, where: str = where, kind: str = kind
    ) -> None:
      if np.any(v != 0):
        raise ValueError(
          f"{what}: {refusal.field} is traced (as optax.inject_hyperparams passes it) and "
          f"{float(np.max(v))!r} when the step runs; the gradient at {where} is {kind}: "
          + refusal.message(float(np.max(v)))
        )

    jax.debug.callback(raise_if_nonzero, value)
    nonzero = jnp.any(value != 0)
    for i in hit:
      path, grad = guarded[i]
      if isinstance(grad, sparse.BCOO):
        grad = sparse.BCOO(
          (grad.data, padding_if(nonzero, grad)),
          shape=grad.shape,
          indices_sorted=grad.indices_sorted,
          unique_indices=grad.unique_indices,
        )
      else:
        grad = jnp.where(nonzero, jnp.zeros_like(grad), grad)
      guarded[i] = (path, grad)
  return guarded


def check_max_norm(
  max_norm: Any, catch_up_idle_rows: bool = False, *, name: str = "sparse_adam"
) -> float | None:
  """`max_norm` as a float, or None; refused unless a positive number (and without catch-up)."""
  if max_norm is None:
    return None
  if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
    raise ValueError(f"{name}: max_norm must be a positive float or None, got {max_norm!r}")
  if catch_up_idle_rows:
    raise ValueError(
      f"{name}: max_norm does not compose with catch_up_idle_rows=True: the catch-up of "
      "rows that are not stepped (catch_up_rows, catch_up_all_rows) does not renormalise. "
      "Pass one of them."
    )
  return float(max_norm)
