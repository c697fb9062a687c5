"""`sparse_value_and_grad` / `sparse_grad`: BCOO gradients for tables, dense for the rest.

The differentiated call is traced twice: once abstractly under
`jax.value_and_grad` to record which tables are looked up with which ids shapes,
which lookups reach the loss differentiably, and which tables are also read
densely (`_tables._Tape`); then with a zero perturbation per live lookup, whose
cotangents are the rows' gradients, and the densely read tables differentiated
as ordinary arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import sparse

from optax_sparse_adam._core.errors import describe, path_str
from optax_sparse_adam.flax._tables import (
  SparseTable,
  _is_table_box,
  _is_variable,
  _recording,
  _Tape,
)


def _table_gradient(
  table: jax.Array,
  ids: list[jax.Array],
  cotangents: list[jax.Array | None],
  dense: jax.Array | None,
) -> Any:
  """The gradient of a table as a BCOO, from its live lookups and its dense use.

  Lookups whose cotangent is None (not live) add no entries. Padding ids become
  the out-of-range row `V` with zero values, which every consumer drops. With a
  dense use the BCOO holds every row once (sorted, unique): the dense cotangent
  plus the lookups' rows, so the step touches the whole table. None when the
  table has neither.
  """
  num_rows, features = table.shape
  live = [(i, c) for i, c in zip(ids, cotangents, strict=True) if c is not None]
  if not live and dense is None:
    return None
  if live:
    flat_ids = jnp.concatenate([jnp.ravel(i).astype(jnp.int32) for i, _ in live])
    valid = (flat_ids >= 0) & (flat_ids < num_rows)
    flat_ids = jnp.where(valid, flat_ids, num_rows)
    data = jnp.concatenate([c.reshape(-1, features) for _, c in live]).astype(table.dtype)
    # Padding reads constant zero rows: whatever reached them is not a gradient.
    data = jnp.where(valid[:, None], data, jnp.zeros((), data.dtype))
  if dense is None:
    return sparse.BCOO((data, flat_ids[:, None]), shape=table.shape)
  full = jnp.asarray(dense).astype(table.dtype)
  if live:
    full = full.at[flat_ids].add(data, mode="drop")
  rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
  return sparse.BCOO((full, rows), shape=table.shape, indices_sorted=True, unique_indices=True)


def _perturbations(
  tables: Sequence[Any], recorded_ids: Any, live: Any
) -> list[list[jax.Array | None]]:
  """Zero perturbations of the live lookups' rows; None for the others."""
  return [
    [
      jnp.zeros(tuple(i.shape) + (t.shape[1],), t.dtype) if is_live else None
      for i, is_live in zip(ids, table_live, strict=True)
    ]
    for t, ids, table_live in zip(tables, recorded_ids, live, strict=True)
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


def _differentiate(call: Callable[..., Any], dense_args: Any, other_args: Any, arrays: list) -> Any:
  """Runs `call(dense_args, perturbations, dense_tables, arrays, live, *other_args)` twice.

  First abstractly under `jax.value_and_grad` with a recording tape, to learn
  the lookups' shapes, which lookups are live and which tables are used
  densely; then for real, differentiating the dense arguments, the live
  lookups' perturbations and the densely used tables.

  Returns:
    `((loss, aux, extra), (dense_grads, cotangents, dense_table_grads), ids)`.
  """
  recorder: list[_Tape] = []

  def record(dense_args, arrays, *other_args):
    return call(dense_args, None, arrays, arrays, recorder, *other_args)

  jax.eval_shape(
    lambda d, a, *o: jax.value_and_grad(record, argnums=(0, 1), has_aux=True)(d, a, *o),
    dense_args,
    arrays,
    *other_args,
  )
  (tape,) = recorder
  live, dense_use = tape.live, tape.dense_use
  perturbations = _perturbations(arrays, tape.ids, live)
  dense_tables = [a if used else None for a, used in zip(arrays, dense_use, strict=True)]
  (loss, (aux, extra, ids)), grads = jax.value_and_grad(call, argnums=(0, 1, 2), has_aux=True)(
    dense_args, perturbations, dense_tables, arrays, live, *other_args
  )
  return (loss, aux, extra), grads, ids


def _merge_tables(dense_tables: list, arrays: list) -> list:
  return [a if d is None else d for d, a in zip(dense_tables, arrays, strict=True)]


def _new_tape(arrays: list, names: list, perturbations: Any, live_or_recorder: Any) -> _Tape:
  if perturbations is None:
    tape = _Tape(arrays, names)
    live_or_recorder.append(tape)
    return tape
  return _Tape(arrays, names, perturbations, live_or_recorder)


def _nnx_value_and_grad(fun, argnums, has_aux, wrt, args, kwargs):
  target = args[argnums]
  graphdef, *states = nnx.split(target, nnx.All(SparseTable, wrt), wrt, ...)
  tables, params, rest = states
  table_leaves, tables_def = jax.tree_util.tree_flatten_with_path(tables, is_leaf=_is_variable)
  names = [path_str(p) for p, _ in table_leaves]
  table_vars = [v for _, v in table_leaves]
  arrays = [v.get_value() for v in table_vars]

  # Pure states in, so that the traced calls build their own Variables and may
  # mutate them (a Variable made outside a trace refuses writes inside it).
  def call(params, perturbations, dense_tables, arrays, live, rest):
    tape = _new_tape(_merge_tables(dense_tables, arrays), names, perturbations, live)
    model = nnx.merge(graphdef, jax.tree.unflatten(tables_def, tape.views), params, rest)
    call_args = args[:argnums] + (model,) + args[argnums + 1 :]
    with _recording(tape):
      loss, aux = _split_output(fun(*call_args, **kwargs), has_aux)
    _check_loss(loss)
    new_rest = nnx.as_pure(nnx.state(model, nnx.Not(wrt)))
    # Tables a lookup wrote (max_norm's in-place renorm) go back to the module too.
    table_state = nnx.state(model, nnx.All(SparseTable, wrt))
    new_tables = [v.get_value() for v in jax.tree.leaves(table_state, is_leaf=_is_variable)]
    written = [n if n is not v else None for n, v in zip(new_tables, tape.views, strict=True)]
    return loss, (aux, (new_rest, written), tape.ids)

  (loss, aux, (new_rest, written)), (param_grads, cotangents, dense_grads), ids = _differentiate(
    call, nnx.as_pure(params), (nnx.as_pure(rest),), arrays
  )
  param_grads = jax.tree.map(
    lambda v, g: v.replace(value=g), params, param_grads, is_leaf=_is_variable
  )
  table_grads = jax.tree.unflatten(
    tables_def,
    [
      v.replace(value=_table_gradient(a, i, c, d))
      for v, a, i, c, d in zip(table_vars, arrays, ids, cotangents, dense_grads, strict=True)
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
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(
    args[argnums], is_leaf=_is_table_box
  )
  leaves = [x for _, x in leaves_with_path]
  is_table = [_is_table_box(x) for x in leaves]
  boxes = [x for x, t in zip(leaves, is_table, strict=True) if t]
  names = [path_str(p) for (p, x) in leaves_with_path if _is_table_box(x)]
  dense = [x for x, t in zip(leaves, is_table, strict=True) if not t]
  arrays = [b.value for b in boxes]
  if len({id(a) for a in arrays}) != len(arrays):
    raise ValueError(
      "sparse_value_and_grad: two SparseTableBox leaves hold the same array "
      "object, so their lookups cannot be told apart. Give each table its own "
      "array (a shared table is one leaf looked up several times)."
    )

  def call(dense, perturbations, dense_tables, arrays, live):
    tape = _new_tape(_merge_tables(dense_tables, arrays), names, perturbations, live)
    dense_iter, table_iter = iter(dense), iter(zip(boxes, tape.views, strict=True))
    merged = []
    for t in is_table:
      if t:
        box, view = next(table_iter)
        merged.append(box.replace_boxed(view))
      else:
        merged.append(next(dense_iter))
    call_args = args[:argnums] + (jax.tree.unflatten(treedef, merged),) + args[argnums + 1 :]
    with _recording(tape):
      loss, aux = _split_output(fun(*call_args, **kwargs), has_aux)
    _check_loss(loss)
    return loss, (aux, None, tape.ids)

  (loss, aux, _), (dense_grads, cotangents, dense_table_grads), ids = _differentiate(
    call, dense, (), arrays
  )
  dense_iter = iter(dense_grads)
  table_iter = iter(zip(boxes, arrays, ids, cotangents, dense_table_grads, strict=True))
  grads = []
  for t in is_table:
    if t:
      box, array, i, c, d = next(table_iter)
      grads.append(box.replace_boxed(_table_gradient(array, i, c, d)))
    else:
      grads.append(next(dense_iter))
  return (loss, aux), jax.tree.unflatten(treedef, grads)


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
  Padding ids (outside `[0, V)`) appear as the out-of-range row `V` with zero
  values. A lookup whose rows do not reach the loss (unused, or only through
  `lax.stop_gradient`) adds no entries, as torch's `.detach()`. A table that
  was not looked up gets a None gradient (as torch leaves `.grad` None), and
  `sparse_adam` does not advance its step. A table also read otherwise than by
  a lookup (a tied output projection `h @ table.T`) gets its full gradient as a
  BCOO holding every row once, so that step is dense for it. A lookup inside a
  transform nested in `fun` (`jax.vmap`, `lax.scan`, `lax.cond`, `nnx.remat`,
  `nn.remat`, ...) raises a ValueError naming the table. Every other
  parameter gets the ordinary dense gradient.

  `fun` is traced twice: once abstractly (`jax.eval_shape` of its gradient) to
  find the lookups' shapes and uses, then to differentiate. Use inside
  `nnx.jit` / `jax.jit`.

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
