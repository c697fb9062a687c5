"""The tables of the Flax glue and the lookup that records them.

`jax.grad` through `table[ids]` (what `nnx.Embed` and `nn.Embed` do) builds a
dense `V x D` gradient by scatter-adding into zeros, and `optax.apply_updates`
densifies a BCOO update. Here the table is kept out of the differentiated state:
each lookup through `embedding_lookup` adds a zero perturbation to the rows it
gathers, and `sparse_value_and_grad` (`_grads`) differentiates with respect to
those perturbations. The cotangent of a perturbation is the cotangent of the
rows, so a table's gradient is the BCOO `(ids, row cotangents)` of its lookups
in the step: nothing in the compiled step is `V x D` besides the table and its
moments. Probes (custom VJPs whose backward rule JAX skips on a symbolic zero
cotangent) tell which lookups reach the loss and which tables are also read
densely.

Tables are marked by type: an NNX `SparseTable` variable (what `SparseEmbed`
holds) or a Linen `SparseTableBox` (what `LinenSparseEmbed` stores in
`params`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from flax.core import meta
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jax_core

from optax_sparse_adam._core import ragged
from optax_sparse_adam._core.errors import describe
from optax_sparse_adam._core.sharded import lookup

# nnx.Embed's and nn.Embed's initializer, so the tables are drop-ins.
default_embed_init = jax.nn.initializers.variance_scaling(
  1.0, "fan_in", "normal", in_axis=-1, out_axis=0
)


class SparseTable(nnx.Param):
  """An NNX parameter (a `nnx.Param`) whose gradient `sparse_value_and_grad` returns as BCOO.

  Its value is a `(num_embeddings, features)` table, looked up through
  `embedding_lookup` (which `SparseEmbed` does). A table also read otherwise (a
  tied output projection `h @ table.T`) gets the full gradient under
  `sparse_value_and_grad`: a BCOO holding every row, so that step is dense.
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

  def replace_boxed(self, val: Any) -> SparseTableBox:
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> SparseTableBox:
    del index, params
    return self

  def remove_axis(self, index: int, params: dict[Any, Any]) -> SparseTableBox:
    del index, params
    return self


def _is_table_box(x: Any) -> bool:
  return isinstance(x, SparseTableBox)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


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
        _bwd_probe(functools.partial(self.dense_use.__setitem__, i, True))(t)
        for i, t in enumerate(tables)
      ]
    else:
      self.views = list(tables)
    self.index_of = {id(view): i for i, view in enumerate(self.views)}
    self.replacements: list[jax.Array] = []  # keeps replaced tables alive, so ids stay unique

  def replace(self, old: jax.Array, new: jax.Array) -> None:
    """Makes `new` (a renormalised `old`, max_norm) the same table for the lookups that follow."""
    i = self.index_of.get(id(old))
    if i is not None:
      self.index_of[id(new)] = i
      self.replacements.append(new)

  def name_of_unknown(self, array: jax.Array) -> str:
    """Best guess of a table's path from its shape, for a table seen through a transform."""
    shape, dtype = jnp.shape(array), jnp.result_type(array)
    # A transform may also slice a stacked table (an nnx.vmap ensemble).
    matches = [
      n
      for n, t in zip(self.names, self.raw, strict=True)
      if t.shape[t.ndim - len(shape) :] == shape and t.dtype == dtype
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


def replace_table(old: jax.Array, new: jax.Array) -> None:
  """Records that `new` (a renormalised `old`) is the same table for the lookups that follow."""
  tape = _active_tape()
  if tape is not None:
    tape.replace(old, new)


def _gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  # Negative ids are padding (zero rows), not Python-style wrap-around. A table
  # split by rows over the axis the ids are split over is read routed: ids to
  # the rows' owners, rows back (docs/sharding.md).
  return lookup.lookup_or_zeros(table, ids)


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
  if type(ids).__name__ == "DynamicJaxprTracer":  # traced for a compiled step (jit)
    ragged.note_traced_ids(
      f"The embedding table of shape {tuple(array.shape)} ({array.dtype})",
      (tuple(array.shape), str(array.dtype)),
      tuple(ids.shape),
    )
  tape = _active_tape()
  if tape is not None:
    rows = tape.lookup(array, ids)
    if rows is not None:
      return rows
    is_table = (is_variable and isinstance(table, SparseTable)) or owner is not None
    if is_table:
      what = (
        tape.name_of_unknown(array)
        if owner is None
        else f"the table of the {type(owner).__name__} at {'/'.join(owner.path) or '<root>'}"
      )
      if _trace_state() != tape.trace_state:
        _raise_nested(what)
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
