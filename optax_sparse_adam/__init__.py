"""optax_sparse_adam: masked Adam for BCOO gradients, with torch.optim.SparseAdam's numerics."""

from optax_sparse_adam._bcoo import coalesce_rows as coalesce_rows
from optax_sparse_adam._checks import check_sparse_grads as check_sparse_grads
from optax_sparse_adam._checks import sparse_grad_checks as sparse_grad_checks
from optax_sparse_adam._composition import RowBuffer as RowBuffer
from optax_sparse_adam._composition import SparseMultiStepsState as SparseMultiStepsState
from optax_sparse_adam._composition import lift_to_bcoo as lift_to_bcoo
from optax_sparse_adam._composition import sparse_apply_if_finite as sparse_apply_if_finite
from optax_sparse_adam._composition import sparse_multi_steps as sparse_multi_steps
from optax_sparse_adam._cpu_kernel import available as cpu_kernels_available
from optax_sparse_adam._cpu_kernel import use_cpu_kernels as use_cpu_kernels
from optax_sparse_adam._huge_pages import HugePageAdvice as HugePageAdvice
from optax_sparse_adam._huge_pages import advise_huge_pages as advise_huge_pages
from optax_sparse_adam._math import AdamCoefficients as AdamCoefficients
from optax_sparse_adam._math import LeafState as LeafState
from optax_sparse_adam._math import sparse_adam_leaf_step as sparse_adam_leaf_step
from optax_sparse_adam._transform import SparseAdamState as SparseAdamState
from optax_sparse_adam._transform import apply_updates as apply_updates
from optax_sparse_adam._transform import sparse_adam as sparse_adam
from optax_sparse_adam._transform import sparse_adamw as sparse_adamw
from optax_sparse_adam._version import __version__ as __version__

# The Flax glue is importable from the top level, but loaded on first use: flax
# is an optional dependency and takes a second to import.
_FLAX_NAMES = (
  "LinenSparseEmbed",
  "SparseEmbed",
  "SparseOptimizer",
  "SparseTable",
  "SparseTableBox",
  "SparseTrainState",
  "embedding_lookup",
  "sparse_grad",
  "sparse_value_and_grad",
  "table_labels",
  "use_cpu_kernels",
)


def __getattr__(name: str):
  if name == "flax":
    import importlib

    return importlib.import_module("optax_sparse_adam.flax")
  if name in _FLAX_NAMES:
    try:
      from optax_sparse_adam import _flax
    except ModuleNotFoundError as err:
      if err.name != "flax":
        raise
      raise ModuleNotFoundError(
        f"optax_sparse_adam.{name} is part of the Flax glue, which needs flax: "
        "pip install 'optax_sparse_adam[flax]'.",
        name="flax",
      ) from err
    return getattr(_flax, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = (
  "AdamCoefficients",
  "HugePageAdvice",
  "LeafState",
  "LinenSparseEmbed",
  "RowBuffer",
  "SparseAdamState",
  "SparseEmbed",
  "SparseMultiStepsState",
  "SparseOptimizer",
  "SparseTable",
  "SparseTableBox",
  "SparseTrainState",
  "advise_huge_pages",
  "apply_updates",
  "check_sparse_grads",
  "coalesce_rows",
  "cpu_kernels_available",
  "embedding_lookup",
  "lift_to_bcoo",
  "sparse_adam",
  "sparse_adam_leaf_step",
  "sparse_adamw",
  "sparse_apply_if_finite",
  "sparse_grad",
  "sparse_grad_checks",
  "sparse_multi_steps",
  "sparse_value_and_grad",
  "table_labels",
  "use_cpu_kernels",
)
