"""The tables of the Flax glue and the lookup that records them.

`jax.grad` through `table[ids]` (what `nnx.Embed` and `nn.Embed` do) builds a
dense `V x D` gradient by scatter-adding into zeros, and `optax.apply_updates`
densifies a BCOO update. Here the table is kept out of the differentiated state:
each lookup through `embedding_lookup` adds a zero perturbation to the rows it
gathers, and `sparse_value_and_grad` (`_grads`) differentiates with respect to
those perturbations. The cotangent of a perturbation is the cotangent of the
rows, so a table's gradient is the BCOO `(ids, row cotangents)` of all its
lookups in the step: nothing in the compiled step is `V x D` besides the table
and its moments.

Tables are marked by type: an NNX `SparseTable` variable (what `SparseEmbed`
holds) or a Linen `SparseTableBox` (what `LinenSparseEmbed` stores in
`params`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from flax.core import meta
from jax import lax

from optax_sparse_adam._core.errors import describe

# nnx.Embed's and nn.Embed's initializer, so the tables are drop-ins.
default_embed_init = jax.nn.initializers.variance_scaling(
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


class _Tape:
  """The lookups of one traced call: which table, which ids, and the rows' perturbations.

  Tables are recognised by the identity of their array, which `nnx.merge` and
  Linen's `apply` pass through unchanged. With `perturbations=None` the tape
  only records (the shape pass); otherwise the k-th lookup of table i returns
  `rows + perturbations[i][k]`.
  """

  def __init__(self, tables: Sequence[jax.Array], perturbations: Any = None):
    self.index_of = {id(table): i for i, table in enumerate(tables)}
    self.perturbations = perturbations
    self.ids: list[list[jax.Array]] = [[] for _ in tables]
    self.replacements: list[jax.Array] = []  # keeps replaced tables alive, so ids stay unique

  def replace(self, old: jax.Array, new: jax.Array) -> None:
    i = self.index_of.get(id(old))
    if i is not None:
      self.index_of[id(new)] = i
      self.replacements.append(new)

  def lookup(self, table: jax.Array, ids: jax.Array) -> jax.Array | None:
    i = self.index_of.get(id(table))
    if i is None:
      return None
    k = len(self.ids[i])
    self.ids[i].append(ids)
    rows = _gather(lax.stop_gradient(table), ids)
    if self.perturbations is None:
      return rows
    perturbation = self.perturbations[i][k]
    if perturbation.shape != rows.shape:
      raise ValueError(
        f"Lookup {k} of sparse table {i} gathered rows of shape {rows.shape}, but "
        f"the shape pass recorded {perturbation.shape}: the loss function must "
        "look tables up in the same order with the same shapes on every trace."
      )
    return rows + perturbation


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
  # Negative ids are padding (zero rows), not Python-style wrap-around.
  num_rows = table.shape[0]
  ids = jnp.where(ids < 0, num_rows, ids)
  return table.at[ids].get(mode="fill", fill_value=0)


def embedding_lookup(table: Any, ids: Any) -> jax.Array:
  """`table[ids]`, recorded so that `sparse_value_and_grad` gives the table a BCOO gradient.

  Ids outside `[0, num_embeddings)`, negative ones included, are padding: they
  read zero rows and get no gradient. Outside `sparse_value_and_grad` this is an
  ordinary gather (and `jax.grad` gives the usual dense gradient).

  Args:
    table: a `(num_embeddings, features)` array, or an NNX `SparseTable`.
    ids: integer array of any shape.

  Returns:
    The rows, of shape `ids.shape + (features,)`.
  """
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
    if is_variable and isinstance(table, SparseTable):
      raise ValueError(
        "embedding_lookup: a SparseTable was looked up inside sparse_value_and_grad "
        "but is not part of the differentiated model (or it was looked up inside a "
        "nested transform such as nnx.remat or jax.vmap, which hides it). Pass the "
        "module that owns it as the differentiated argument and look it up "
        "outside nested transforms."
      )
  return _gather(array, ids)
