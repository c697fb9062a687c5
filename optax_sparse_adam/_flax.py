"""Flax glue: embedding tables with BCOO gradients, and optimizers that apply them by scatter.

`jax.grad` through `table[ids]` (what `nnx.Embed` and `nn.Embed` do) builds a
dense `V x D` gradient by scatter-adding into zeros, and `optax.apply_updates`
densifies a BCOO update. Here the table is kept out of the differentiated state:
each lookup through `embedding_lookup` adds a zero perturbation to the rows it
gathers, and `sparse_value_and_grad` differentiates with respect to those
perturbations. The cotangent of a perturbation is the cotangent of the rows, so
a table's gradient is the BCOO `(ids, row cotangents)` of all its lookups in the
step: nothing in the compiled step is `V x D` besides the table and its moments.

Tables are marked by type: an NNX `SparseTable` variable (what `SparseEmbed`
holds) or a Linen `SparseTableBox` (what `LinenSparseEmbed` stores in
`params`). `table_labels` labels them 'sparse' for `optax.multi_transform`, and
`SparseOptimizer` / `SparseTrainState` apply the updates with
`optax_sparse_adam.apply_updates` (scatter-add, never densified).
"""

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx, struct
from flax.core import meta
from flax.training import train_state
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import sparse
from jax.extend import core as jax_core

from optax_sparse_adam import _transform
from optax_sparse_adam._errors import describe, path_str

_default_embed_init = jax.nn.initializers.variance_scaling(
  1.0, "fan_in", "normal", in_axis=-1, out_axis=0
)


class SparseTable(nnx.Param):
  """An NNX parameter (a `nnx.Param`) whose gradient `sparse_value_and_grad` returns as BCOO.

  Its value is a `(num_embeddings, features)` table read only through
  `embedding_lookup` (which `SparseEmbed` does). Use of the table other than
  through `embedding_lookup` (for example a tied output projection) gets no
  gradient from `sparse_value_and_grad`: use an ordinary `nnx.Param` for it.
  """


class SparseTableBox(struct.PyTreeNode, meta.AxisMetadata):
  """Linen metadata box marking a `params` leaf as a table with BCOO gradients.

  `LinenSparseEmbed` stores its table boxed; `Module.param` unboxes it, so
  `apply` sees a plain array, while `model.init(...)['params']`, the train
  state and the gradients keep the box. `table_labels` and
  `sparse_value_and_grad` recognise tables by it.

  Attributes:
    value: the table, or its gradient or update (a BCOO) in a gradient tree.
  """

  value: Any

  def unbox(self) -> Any:
    return self.value

  def replace_boxed(self, val: Any) -> "SparseTableBox":
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> "SparseTableBox":
    del index, params
    return self

  def remove_axis(self, index: int, params: dict[Any, Any]) -> "SparseTableBox":
    del index, params
    return self


def _is_table_box(x: Any) -> bool:
  return isinstance(x, SparseTableBox)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


# ---------------------------------------------------------------------------
# Lookups and the tape that records them.


def _trace_state() -> Any:
  return jax_core.get_opaque_trace_state(convention="optax_sparse_adam")


def _bwd_probe(on_cotangent: Callable[[], None]) -> Callable[[jax.Array], jax.Array]:
  """The identity, whose backward rule calls `on_cotangent` when a cotangent reaches it.

  JAX skips a custom VJP rule whose output cotangent is a symbolic zero: the
  output was unused, or reached the loss only through `lax.stop_gradient`. So a
  call of `on_cotangent` (at trace time under `jit`) means the value is
  differentiably used, which is what decides whether a lookup is a gradient
  entry (torch leaves `.detach()`ed and unused lookups out of the gradient).
  """

  @jax.custom_vjp
  def probe(x):
    return x

  def fwd(x):
    return x.value, None

  def bwd(_, cotangent):
    if isinstance(cotangent, SymbolicZero):
      return (None,)
    on_cotangent()
    return (cotangent,)

  probe.defvjp(fwd, bwd, symbolic_zeros=True)
  return probe


class _Tape:
  """The lookups of one traced call: which table, which ids, which are differentiably used.

  Tables are recognised by the identity of their array, which `nnx.merge` and
  Linen's `apply` pass through unchanged. In the recording pass
  (`perturbations=None`, run abstractly under `jax.value_and_grad`) each table
  is handed to the model behind a probe that notes a dense use (the table read
  other than by a lookup, e.g. a tied projection `h @ table.T`), and each
  lookup's rows go through a probe that notes whether they reach the loss.
  In the differentiating pass, the k-th lookup of table i returns
  `rows + perturbations[i][k]` if it was found live, else the rows as constants.
  """

  def __init__(
    self,
    tables: Sequence[jax.Array],
    names: Sequence[str],
    perturbations: Any = None,
    live: Any = None,
  ):
    self.names = list(names)
    self.recording = perturbations is None
    self.perturbations = perturbations
    self.raw = list(tables)
    self.ids: list[list[jax.Array]] = [[] for _ in tables]
    self.live: list[list[bool]] = [[] for _ in tables] if live is None else live
    self.dense_use = [False] * len(tables)
    self.trace_state = _trace_state()
    if self.recording:
      self.views = [
        _bwd_probe(lambda i=i: self.dense_use.__setitem__(i, True))(t) for i, t in enumerate(tables)
      ]
    else:
      self.views = list(tables)
    self.index_of = {id(view): i for i, view in enumerate(self.views)}

  def name_of_unknown(self, array: jax.Array) -> str:
    """Best guess of a table's path from its shape, for a table seen through a transform."""
    shape, dtype = jnp.shape(array), jnp.result_type(array)
    matches = [
      n for n, t in zip(self.names, self.raw, strict=True) if t.shape == shape and t.dtype == dtype
    ]
    if len(matches) == 1:
      return f"the table at {matches[0]}"
    return f"a table of shape {tuple(shape)} ({describe(array)})"

  def lookup(self, table: jax.Array, ids: jax.Array) -> jax.Array | None:
    i = self.index_of.get(id(table))
    if i is None:
      return None
    if _trace_state() != self.trace_state:
      _raise_nested(f"the table at {self.names[i]}")
    k = len(self.ids[i])
    self.ids[i].append(ids)
    if self.recording:
      # Gathered from the raw table, so the dense-use probe sees only other uses.
      self.live[i].append(False)
      rows = _gather(self.raw[i], ids)
      return _bwd_probe(lambda: self.live[i].__setitem__(k, True))(rows)
    rows = _gather(lax.stop_gradient(table), ids)
    if k >= len(self.live[i]):
      raise ValueError(
        f"Sparse table at {self.names[i]} was looked up {k + 1} times, but "
        f"{len(self.live[i])} times in the recording pass: the loss function must "
        "look tables up in the same order with the same shapes on every trace."
      )
    perturbation = self.perturbations[i][k]
    if perturbation is None:
      return rows
    if perturbation.shape != rows.shape:
      raise ValueError(
        f"Lookup {k} of the sparse table at {self.names[i]} gathered rows of shape "
        f"{rows.shape}, but the recording pass found {perturbation.shape}: the loss "
        "function must look tables up in the same order with the same shapes on "
        "every trace."
      )
    return rows + perturbation


def _raise_nested(what: str) -> None:
  raise ValueError(
    f"embedding_lookup: {what} was looked up inside a nested transform within "
    "sparse_value_and_grad (jax.vmap, lax.scan, lax.cond, jax.checkpoint, jax.jit; "
    "nnx.vmap/nnx.scan/nnx.remat/nnx.jit/nnx.cond; nn.vmap/nn.scan/nn.remat/nn.jit), "
    "where its BCOO gradient cannot be recorded. Look the table up in the "
    "differentiated function itself and pass the rows into the transformed part "
    "(e.g. gather every time step's ids at once before a scan, and remat only the "
    "blocks after the embedding), or keep this table dense (nnx.Param / nn.Embed "
    "with a dense optimizer such as optax.adam)."
  )


_local = threading.local()


def _active_tape() -> _Tape | None:
  stack = getattr(_local, "tapes", None)
  return stack[-1] if stack else None


@contextlib.contextmanager
def _recording(tape: _Tape):
  stack = getattr(_local, "tapes", None)
  if stack is None:
    stack = _local.tapes = []
  stack.append(tape)
  try:
    yield tape
  finally:
    stack.pop()


def _gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  # Negative ids are padding (zero rows), not Python-style wrap-around.
  num_rows = table.shape[0]
  ids = jnp.where(ids < 0, num_rows, ids)
  return table.at[ids].get(mode="fill", fill_value=0)


def embedding_lookup(table: Any, ids: Any) -> jax.Array:
  """`table[ids]`, recorded so that `sparse_value_and_grad` gives the table a BCOO gradient.

  Ids outside `[0, num_embeddings)`, negative ones included, are padding: they
  read zero rows and get no gradient. Outside `sparse_value_and_grad` this is an
  ordinary gather (and `jax.grad` gives the usual dense gradient). Under
  `sparse_value_and_grad`, a lookup whose rows do not reach the loss (unused, or
  only through `lax.stop_gradient`) adds no entries, like torch's `.detach()`.

  Args:
    table: a `(num_embeddings, features)` array, or an NNX `SparseTable`.
    ids: integer array of any shape.

  Returns:
    The rows, of shape `ids.shape + (features,)`.
  """
  return _lookup(table, ids, owner=None)


def _lookup(table: Any, ids: Any, *, owner: Any) -> jax.Array:
  """`embedding_lookup`; `owner` is the Linen module whose table `table` is, if any."""
  is_variable = _is_variable(table)
  array = table.get_value() if is_variable else table
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
      f"embedding_lookup: ids must be integers, got {describe(ids)}. Cast them "
      "with ids.astype(jnp.int32)."
    )
  if jnp.ndim(array) != 2:
    raise ValueError(
      f"embedding_lookup: the table must be (num_embeddings, features), got {describe(array)}."
    )
  tape = _active_tape()
  if tape is not None:
    rows = tape.lookup(array, ids)
    if rows is not None:
      return rows
    is_table = (is_variable and isinstance(table, SparseTable)) or owner is not None
    if is_table and _trace_state() != tape.trace_state:
      _raise_nested(
        tape.name_of_unknown(array)
        if owner is None
        else f"the table of the LinenSparseEmbed at {'/'.join(owner.path) or '<root>'}"
      )
    if is_table:
      what = (
        tape.name_of_unknown(array)
        if owner is None
        else f"the table of the LinenSparseEmbed at {'/'.join(owner.path) or '<root>'}"
      )
      raise ValueError(
        f"embedding_lookup: {what} was looked up inside sparse_value_and_grad, but "
        "it is not one of the differentiated tables: either it is not part of the "
        "differentiated argument, or the params were transformed inside the loss "
        "function (cast to bfloat16, copied, tree-mapped), which makes a new array "
        "whose lookups cannot be recorded. Pass the module (NNX) or the params "
        "(Linen) holding it as the differentiated argument, unchanged; for lower "
        "precision compute, set dtype= on the embedding (rows are cast after the "
        "lookup) or store the table in that dtype with param_dtype=."
      )
  return _gather(array, ids)


# ---------------------------------------------------------------------------
# Modules.


class SparseEmbed(nnx.Module):
  """An NNX embedding whose table gets BCOO gradients under `sparse_value_and_grad`.

  A drop-in for `nnx.Embed` (same initializer, same call), except that ids
  outside `[0, num_embeddings)` read zero rows instead of NaNs. Under
  `nnx.grad` it behaves like `nnx.Embed` (dense gradient).

  Args:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    dtype: dtype of the returned rows; default the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
    rngs: `nnx.Rngs` with a `params` stream.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> embed = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
    >>> loss = lambda m: (m(jnp.array([1, 1, 7])) ** 2).sum()
    >>> grads = osa.sparse_grad(loss)(embed)
    >>> grads["embedding"].get_value().indices[:, 0]
    Array([1, 1, 7], dtype=int32)
  """

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    embedding_init: Callable[..., jax.Array] = _default_embed_init,
    rngs: nnx.Rngs,
  ):
    self.num_embeddings = num_embeddings
    self.features = features
    self.dtype = dtype
    self.embedding = SparseTable(
      embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
    )

  def __call__(self, inputs: jax.Array) -> jax.Array:
    rows = embedding_lookup(self.embedding, inputs)
    return rows if self.dtype is None else rows.astype(self.dtype)


class LinenSparseEmbed(nn.Module):
  """A Linen embedding whose table gets BCOO gradients under `sparse_value_and_grad`.

  A drop-in for `nn.Embed` (same initializer, the param is also named
  `embedding`), except that the param is stored in a `SparseTableBox` and ids
  outside `[0, num_embeddings)` read zero rows instead of NaNs.

  Attributes:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    dtype: dtype of the returned rows; default the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
  """

  num_embeddings: int
  features: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  embedding_init: Callable[..., jax.Array] = _default_embed_init

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    table = self.param(
      "embedding",
      lambda key, shape, dtype: SparseTableBox(self.embedding_init(key, shape, dtype)),
      (self.num_embeddings, self.features),
      self.param_dtype,
    )
    rows = _lookup(table, inputs, owner=self)
    return rows if self.dtype is None else rows.astype(self.dtype)


# ---------------------------------------------------------------------------
# Gradients.


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
  graphdef, tables, params, rest = nnx.split(target, nnx.All(SparseTable, wrt), wrt, ...)
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
    return loss, (aux, new_rest, tape.ids)

  (loss, aux, new_rest), (param_grads, cotangents, dense_grads), ids = _differentiate(
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
    call_args = args[:argnums] + (treedef.unflatten(merged),) + args[argnums + 1 :]
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


# ---------------------------------------------------------------------------
# Optimizers.


def table_labels(tree: Any, *, wrt: Any = nnx.Param) -> Any:
  """Labels every table 'sparse' and every other parameter 'dense', for `optax.multi_transform`.

  Args:
    tree: an NNX module (labels its `wrt` state, tables by `SparseTable`
      type), or a Linen params tree (tables are `SparseTableBox` leaves; BCOO
      leaves are labelled 'sparse' too, so the function itself can be passed
      as `multi_transform`'s label function).
    wrt: NNX only: the filter given to the optimizer (default `nnx.Param`).

  Returns:
    A tree of 'sparse' / 'dense' strings, a prefix of the params and grads.

  Example:
    >>> from flax import nnx
    >>> import optax
    >>> import optax_sparse_adam as osa
    >>> embed = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
    >>> tx = optax.multi_transform(
    ...   {"sparse": osa.sparse_adam(1e-3), "dense": optax.adamw(1e-3)},
    ...   osa.table_labels(embed),
    ... )
    >>> optimizer = osa.SparseOptimizer(embed, tx, wrt=nnx.Param)
  """
  if isinstance(tree, nnx.Pytree):
    tree = nnx.state(tree, wrt)

  def label(x: Any) -> str:
    if isinstance(x, (SparseTable, SparseTableBox, sparse.BCOO)):
      return "sparse"
    return "dense"

  return jax.tree.map(
    label,
    tree,
    is_leaf=lambda x: _is_variable(x) or _is_table_box(x) or isinstance(x, sparse.BCOO),
  )


class SparseOptimizer(nnx.Optimizer):
  """An `nnx.Optimizer` that applies BCOO updates by scatter-add instead of densifying them.

  Same constructor and `update(model, grads)` as `nnx.Optimizer`; the only
  difference is `optax_sparse_adam.apply_updates` in place of
  `optax.apply_updates`. Give it `optax.multi_transform({'sparse':
  sparse_adam(...), 'dense': optax.adamw(...)}, table_labels(model))` and the
  grads of `sparse_value_and_grad`; inside `nnx.jit`, donate the model and the
  optimizer so the tables and moments are updated in place.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_sparse_adam as osa
    >>> model = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
    >>> tx = optax.multi_transform(
    ...   {"sparse": osa.sparse_adam(0.1), "dense": optax.adamw(0.1)},
    ...   osa.table_labels(model),
    ... )
    >>> optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)
    >>> @nnx.jit(donate_argnums=(0, 1))
    ... def train_step(model, optimizer, ids):
    ...   loss, grads = osa.sparse_value_and_grad(lambda m: (m(ids) ** 2).sum())(model)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> loss = train_step(model, optimizer, jnp.array([1, 2]))
  """

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> optax.Updates:
    """Updates the optimizer state and the model's parameters from `grads`.

    Args:
      model: the module whose `wrt` state is updated.
      grads: gradients from `sparse_value_and_grad` (or `nnx.grad`).
      **kwargs: extra arguments of `tx.update`.

    Returns:
      The updates (BCOO for tables).
    """
    param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    opt_state_arrays = nnx.as_pure(self.opt_state)
    updates, new_opt_state = self.tx.update(
      grad_arrays, opt_state_arrays, param_arrays, **nnx.as_pure(kwargs)
    )
    new_params = _transform.apply_updates(param_arrays, updates)
    nnx.update(model, new_params)
    # Each state Variable gets its new value whole: `nnx.update` would turn a
    # NamedTuple held by one Variable (a sparse_multi_steps RowBuffer) into a State.
    variables, treedef = jax.tree.flatten(self.opt_state, is_leaf=_is_variable)
    for variable, value in zip(variables, treedef.flatten_up_to(new_opt_state), strict=True):
      variable.set_value(value)
    self.step[...] += 1
    return updates


class SparseTrainState(train_state.TrainState):
  """A Linen `TrainState` whose `apply_gradients` applies BCOO updates by scatter-add.

  Create it as a `TrainState`, with `LinenSparseEmbed` params (boxed tables)
  and a `tx` such as `optax.multi_transform({'sparse': sparse_adam(...),
  'dense': optax.adamw(...)}, table_labels)`; feed it the grads of
  `sparse_value_and_grad`. Inside `jax.jit`, donate the state.
  """

  @classmethod
  def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> "SparseTrainState":
    """Like `TrainState.create`, with `step` an int32 array.

    `TrainState.create` starts `step` as the Python int 0, which makes a jitted
    train step compile twice (int, then array); an array compiles once.
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    return state.replace(step=jnp.zeros([], jnp.int32))

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> "SparseTrainState":
    """Returns the state after one optimizer step: `step + 1`, new params and opt_state.

    Args:
      grads: gradients with the structure of `params` (BCOO in the table boxes).
      **kwargs: other fields to `replace`.

    Returns:
      The updated state.
    """
    updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params)
    new_params = _transform.apply_updates(self.params, updates)
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)
