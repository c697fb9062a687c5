"""optax_sparse_adam: masked Adam for BCOO gradients, with torch.optim.SparseAdam's numerics."""

from optax_sparse_adam._bcoo import coalesce_rows as coalesce_rows
from optax_sparse_adam._composition import RowBuffer as RowBuffer
from optax_sparse_adam._composition import SparseMultiStepsState as SparseMultiStepsState
from optax_sparse_adam._composition import lift_to_bcoo as lift_to_bcoo
from optax_sparse_adam._composition import sparse_apply_if_finite as sparse_apply_if_finite
from optax_sparse_adam._composition import sparse_multi_steps as sparse_multi_steps
from optax_sparse_adam._math import AdamCoefficients as AdamCoefficients
from optax_sparse_adam._math import LeafState as LeafState
from optax_sparse_adam._math import sparse_adam_leaf_step as sparse_adam_leaf_step
from optax_sparse_adam._transform import SparseAdamState as SparseAdamState
from optax_sparse_adam._transform import apply_updates as apply_updates
from optax_sparse_adam._transform import sparse_adam as sparse_adam
from optax_sparse_adam._transform import sparse_adamw as sparse_adamw

__version__ = "0.1.0"

__all__ = (
  "AdamCoefficients",
  "LeafState",
  "RowBuffer",
  "SparseAdamState",
  "SparseMultiStepsState",
  "apply_updates",
  "coalesce_rows",
  "lift_to_bcoo",
  "sparse_adam",
  "sparse_adam_leaf_step",
  "sparse_adamw",
  "sparse_apply_if_finite",
  "sparse_multi_steps",
)
