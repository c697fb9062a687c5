"""optax_sparse_adam: masked Adam for BCOO gradients, with torch.optim.SparseAdam's numerics."""

from optax_sparse_adam._bcoo import coalesce_rows as coalesce_rows
from optax_sparse_adam._checks import check_sparse_grads as check_sparse_grads
from optax_sparse_adam._checks import sparse_grad_checks as sparse_grad_checks
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
  "SparseAdamState",
  "apply_updates",
  "check_sparse_grads",
  "coalesce_rows",
  "sparse_adam",
  "sparse_adam_leaf_step",
  "sparse_adamw",
  "sparse_grad_checks",
)
