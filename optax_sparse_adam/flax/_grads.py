"""`sparse_value_and_grad` / `sparse_grad`: BCOO gradients for tables, dense for the rest.

The differentiated call is traced twice: once abstractly to record which tables
are looked up with which ids shapes (`_tables._Tape`), then with a zero
perturbation per lookup, whose cotangents are the rows' gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import sparse

from optax_sparse_adam._core.errors import describe
from optax_sparse_adam.flax._tables import (
  SparseTable,
  _is_table_box,
  _is_variable,
  _recording,
  _Tape,
)


def _table_gradient(table: jax.Array, ids: list[jax.Array], cotangents: list[jax.Array]) -> Any:
  """The BCOO gradient of a table from its lookups, or None if it was not looked up."""
  if not ids:
    return None
  num_rows, features = table.shape
  flat_ids = jnp.concatenate([jnp.ravel(i).astype(jnp.int32) for i in ids])
  # Padding ids become one out-of-range row, which every consumer drops.
  flat_ids = jnp.where((flat_ids >= 0) & (flat_ids < num_rows), flat_ids, num_rows)
  data = jnp.concatenate([c.reshape(-1, features) for c in cotangents]).astype(table.dtype)
  return sparse.BCOO((data, flat_ids[:, None]), shape=table.shape)


def _zero_perturbations(tables: Sequence[Any], recorded_ids: Any) -> list[list[jax.Array]]:
  return [
    [jnp.zeros(tuple(i.shape) + (t.shape[1],), t.dtype) for i in ids]
    for t, ids in zip(tables, recorded_ids, strict=True)
  ]


def _split_output(out: Any, has_aux: bool) -> tuple[Any, Any]:
  if not has_aux:
    return out, None
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(
      "sparse_value_and_grad(has_aux=True): the function must return a pair "
      f"(loss, aux), got {type(out).__name__}."
    )
  return out


def _check_loss(loss: Any) -> None:
  if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise TypeError(
      "sparse_value_and_grad: the function must return a real scalar loss (or "
      f"(loss, aux) with has_aux=True), got {describe(loss)}."
    )


def _nnx_value_and_grad(fun, argnums, has_aux, wrt, args, kwargs):
  target = args[argnums]
  graphdef, tables, params, rest = nnx.split(target, nnx.All(SparseTable, wrt), wrt, ...)
  table_vars, tables_def = jax.tree.flatten(tables, is_leaf=_is_variable)
  arrays = [v.get_value() for v in table_vars]

  # Pure states in, so that the traced calls build their own Variables and may
  # mutate them (a Variable made outside a trace refuses writes inside it).
  def call(params, perturbations, arrays, rest):
    tables = jax.tree.unflatten(tables_def, arrays)
    model = nnx.merge(graphdef, tables, params, rest)
    tape = _Tape(arrays, perturbations)
    call_args = args[:argnums] + (model,) + args[argnums + 1 :]
    with _recording(tape):
      loss, aux = _split_output(fun(*call_args, **kwargs), has_aux)
    _check_loss(loss)
    new_rest = nnx.as_pure(nnx.state(model, nnx.Not(wrt)))
    # Tables a lookup wrote (max_norm's in-place renorm) go back to the module too.
    table_state = nnx.state(model, nnx.All(SparseTable, wrt))
    new_tables = [v.get_value() for v in jax.tree.leaves(table_state, is_leaf=_is_variable)]
    written = [n if n is not a else None for n, a in zip(new_tables, arrays, strict=True)]
    return loss, (aux, tape.ids, (new_rest, written))

  pure_params, pure_rest = nnx.as_pure(params), nnx.as_pure(rest)
  # Shape pass: which tables are looked up, how many times, with which ids shapes.
  _, (_, recorded, _) = jax.eval_shape(call, pure_params, None, arrays, pure_rest)
  perturbations = _zero_perturbations(arrays, recorded)
  (loss, (aux, ids, (new_rest, written))), (param_grads, cotangents) = jax.value_and_grad(
    call, argnums=(0, 1), has_aux=True
  )(pure_params, perturbations, arrays, pure_rest)
  param_grads = jax.tree.map(
    lambda v, g: v.replace(value=g), params, param_grads, is_leaf=_is_variable
  )
  table_grads = jax.tree.unflatten(
    tables_def,
    [
      v.replace(value=_table_gradient(a, i, c))
      for v, a, i, c in zip(table_vars, arrays, ids, cotangents, strict=True)
    ],
  )
  nnx.update(target, new_rest)
  if any(w is not None for w in written):
    nnx.update(
      target,
      jax.tree.unflatten(
        tables_def,
        [
          v.replace(value=a if w is None else w)
          for v, a, w in zip(table_vars, arrays, written, strict=True)
        ],
      ),
    )
  return (loss, aux), nnx.merge_state(param_grads, table_grads)


def _tree_value_and_grad(fun, argnums, has_aux, args, kwargs):
  leaves, treedef = jax.tree.flatten(args[argnums], is_leaf=_is_table_box)
  is_table = [_is_table_box(x) for x in leaves]
  boxes = [x for x, t in zip(leaves, is_table, strict=True) if t]
  dense = [x for x, t in zip(leaves, is_table, strict=True) if not t]
  arrays = [b.value for b in boxes]
  if len({id(a) for a in arrays}) != len(arrays):
    raise ValueError(
      "sparse_value_and_grad: two SparseTableBox leaves hold the same array "
      "object, so their lookups cannot be told apart. Give each table its own "
      "array (a shared table is one leaf looked up several times)."
    )

  def call(dense, perturbations, arrays):
    dense_iter, table_iter = iter(dense), iter(zip(boxes, arrays, strict=True))
    merged = []
    for t in is_table:
      if t:
        box, array = next(table_iter)
        merged.append(box.replace_boxed(array))
      else:
        merged.append(next(dense_iter))
    tape = _Tape(arrays, perturbations)
    call_args = args[:argnums] + (treedef.unflatten(merged),) + args[argnums + 1 :]
    with _recording(tape):
      loss, aux = _split_output(fun(*call_args, **kwargs), has_aux)
    _check_loss(loss)
    return loss, (aux, tape.ids)

  _, (_, recorded) = jax.eval_shape(call, dense, None, arrays)
  perturbations = _zero_perturbations(arrays, recorded)
  (loss, (aux, ids)), (dense_grads, cotangents) = jax.value_and_grad(
    call, argnums=(0, 1), has_aux=True
  )(dense, perturbations, arrays)
  dense_iter = iter(dense_grads)
  table_iter = iter(zip(boxes, arrays, ids, cotangents, strict=True))
  grads = []
  for t in is_table:
    if t:
      box, array, i, c = next(table_iter)
      grads.append(box.replace_boxed(_table_gradient(array, i, c)))
    else:
      grads.append(next(dense_iter))
  return (loss, aux), treedef.unflatten(grads)


def sparse_value_and_grad(
  fun: Callable[..., Any],
  argnums: int = 0,
  *,
  has_aux: bool = False,
  wrt: Any = nnx.Param,
) -> Callable[..., tuple[Any, Any]]:
  """Like `nnx.value_and_grad` / `jax.value_and_grad`, with BCOO gradients for embedding tables.

  The differentiated argument `args[argnums]` is either an NNX module (graph
  node) or a pytree of Linen params. Its tables (NNX `SparseTable` variables,
  Linen `SparseTableBox` leaves) get as gradient a
  `jax.experimental.sparse.BCOO` of shape `(V, D)` whose entries are the ids of
  every `embedding_lookup` of the table in the call and the cotangents of the
  rows read: no dense `V x D` array is built. Several lookups of one table
  (a table shared by two towers, or looked up twice) concatenate their entries,
  so duplicates add up when densified or coalesced (`sparse_adam` does).
  Padding ids (outside `[0, V)`) appear as the out-of-range row `V`. A table
  that was not looked up gets a None gradient (as torch leaves `.grad` None),
  and `sparse_adam` does not advance its step. Every other parameter gets the
  ordinary dense gradient.

  `fun` is traced twice: once abstractly (`jax.eval_shape`) to find the lookups'
  shapes, then to differentiate. Use inside `nnx.jit` / `jax.jit`.

  Args:
    fun: the loss function, returning a real scalar (or `(loss, aux)` with
      `has_aux=True`).
    argnums: position of the differentiated argument (a single int).
    has_aux: `fun` returns `(loss, aux)`.
    wrt: NNX only: filter of the differentiated variables (default
      `nnx.Param`); tables outside it get no gradient. Non-`wrt` state that
      `fun` mutates (batch statistics, RNG counts) is written back to the
      module, as `nnx.value_and_grad` does.

  Returns:
    A function with `fun`'s arguments returning `(value, grads)`, where value
    is `loss` or `(loss, aux)`. For NNX, grads is an `nnx.State` of the `wrt`
    variables (tables hold BCOO values); for Linen, a tree like the params
    (tables as `SparseTableBox(BCOO)`).

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> class Model(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.embed = osa.SparseEmbed(1000, 8, rngs=rngs)
    ...     self.out = nnx.Linear(8, 1, rngs=rngs)
    ...   def __call__(self, ids):
    ...     return self.out(self.embed(ids)).mean()
    >>> model = Model(nnx.Rngs(0))
    >>> loss, grads = osa.sparse_value_and_grad(lambda m: m(jnp.array([3, 5])))(model)
    >>> grads["embed"]["embedding"].get_value().data.shape
    (2, 8)
  """
  if not isinstance(argnums, int) or isinstance(argnums, bool):
    raise TypeError(f"sparse_value_and_grad: argnums must be one int, got {argnums!r}.")

  def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    if not -len(args) <= argnums < len(args):
      raise ValueError(
        f"sparse_value_and_grad: argnums={argnums} but the function was called "
        f"with {len(args)} positional arguments."
      )
    index = argnums % len(args)
    if isinstance(args[index], nnx.Pytree):
      (loss, aux), grads = _nnx_value_and_grad(fun, index, has_aux, wrt, args, kwargs)
    else:
      (loss, aux), grads = _tree_value_and_grad(fun, index, has_aux, args, kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return value_and_grad_fn


def sparse_grad(
  fun: Callable[..., Any],
  argnums: int = 0,
  *,
  has_aux: bool = False,
  wrt: Any = nnx.Param,
) -> Callable[..., Any]:
  """`sparse_value_and_grad` returning only the gradients (and aux with `has_aux`).

  Args:
    fun: the loss function.
    argnums: position of the differentiated argument.
    has_aux: `fun` returns `(loss, aux)`; then `(grads, aux)` is returned.
    wrt: NNX only: filter of the differentiated variables.

  Returns:
    A function returning `grads`, or `(grads, aux)` with `has_aux=True`.
  """
  value_and_grad_fn = sparse_value_and_grad(fun, argnums, has_aux=has_aux, wrt=wrt)

  def grad_fn(*args: Any, **kwargs: Any) -> Any:
    value, grads = value_and_grad_fn(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return grad_fn
