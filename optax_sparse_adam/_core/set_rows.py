"""`SetRowsUpdate`: a BCOO update that holds a parameter's new rows, to be stored as they are.

A rule that declares `sets_rows` (`rules.RowRule`) computes the touched rows'
new values, not their deltas. Added as a delta, `w + (w_new - w)` is not
`w_new` in floating point (an exact zero, FTRL's L1, comes back as a tiny
residue), so its update is this subclass of `RowUpdate` (the BCOO whose ids carry
their check, `_core.row_update`): the same leaves and metadata, a different type,
which `apply_updates` stores with a scatter-set (padding indices, out of range,
dropped). Its type is part of the pytree structure, so a tree of such updates
cannot be mistaken for deltas.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.sparse import BCOO

from optax_sparse_adam._core.row_update import RowUpdate


@jax.tree_util.register_pytree_node_class
class SetRowsUpdate(RowUpdate):  # type: ignore[metaclass]  # mypy cannot see the metaclass
  """A BCOO update whose entries are the parameter's new values at its rows (not deltas).

  `optax_sparse_adam.apply_updates` stores its entries (`param[rows] = data`),
  where it adds a plain BCOO's. Made by the optax transformation of a rule that
  sets rows (`sparse_ftrl`); its data are in the parameter's dtype. Adding it
  with `+` (as `optax.apply_updates` does) is refused: the sum would be
  `w + w_new`, not `w_new`.
  """

  def __add__(self, other: Any) -> Any:
    raise TypeError(_ADDED)

  def __radd__(self, other: Any) -> Any:
    raise TypeError(_ADDED)


_ADDED = (
  "a SetRowsUpdate holds the parameter's new rows (a rule that sets rows, such as "
  "sparse_ftrl), not deltas: adding it with '+' (optax.apply_updates, nnx.Optimizer) "
  "would give w + w_new. Apply it with optax_sparse_adam.apply_updates, which stores "
  "the rows (osa.SparseOptimizer in Flax NNX)."
)


def as_set_rows(update: BCOO) -> SetRowsUpdate:
  """`update`'s arrays and metadata as a `SetRowsUpdate`."""
  return SetRowsUpdate(
    (update.data, update.indices),
    shape=update.shape,
    indices_sorted=update.indices_sorted,
    unique_indices=update.unique_indices,
  )
