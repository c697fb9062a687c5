"""optax_sparse_adam: masked Adam for BCOO gradients, with torch.optim.SparseAdam's numerics.

The package's layers: `_core` (the Adam arithmetic, BCOO plumbing and optax
glue), `_backends` (how a step runs on each backend), and two front ends,
`optax_sparse_adam.flax` and `optax_sparse_adam.torch_compat`. See
docs/architecture.md.
"""

import importlib

from optax_sparse_adam._backends.cpu.huge_pages import HugePageAdvice as HugePageAdvice
from optax_sparse_adam._backends.cpu.huge_pages import advise_huge_pages as advise_huge_pages
from optax_sparse_adam._backends.cpu.kernels import available as cpu_kernels_available
from optax_sparse_adam._backends.cpu.kernels import use_cpu_kernels as use_cpu_kernels
from optax_sparse_adam._backends.cpu.row_program import report as row_program_report
from optax_sparse_adam._core.coalesce import coalesce_rows as coalesce_rows
from optax_sparse_adam._core.ragged import RaggedIdsWarning as RaggedIdsWarning
from optax_sparse_adam._core.ragged import bucket_size as bucket_size
from optax_sparse_adam._core.ragged import pad_ids as pad_ids
from optax_sparse_adam._core.row_rules.adagrad import AdagradHyperparams as AdagradHyperparams
from optax_sparse_adam._core.row_rules.adagrad import AdagradRule as AdagradRule
from optax_sparse_adam._core.row_rules.adam import AdamCoefficients as AdamCoefficients
from optax_sparse_adam._core.row_rules.adam import LeafState as LeafState
from optax_sparse_adam._core.row_rules.ftrl import FtrlHyperparams as FtrlHyperparams
from optax_sparse_adam._core.row_rules.ftrl import FtrlRule as FtrlRule
from optax_sparse_adam._core.row_rules.rowwise_adagrad import (
  RowwiseAdagradHyperparams as RowwiseAdagradHyperparams,
)
from optax_sparse_adam._core.row_rules.rowwise_adagrad import (
  RowwiseAdagradRule as RowwiseAdagradRule,
)
from optax_sparse_adam._core.row_rules.sgd import SGDHyperparams as SGDHyperparams
from optax_sparse_adam._core.row_rules.sgd import SGDRule as SGDRule
from optax_sparse_adam._core.row_sum import row_sum as row_sum
from optax_sparse_adam._core.row_update import DensifyingUpdateWarning as DensifyingUpdateWarning
from optax_sparse_adam._core.row_update import RowUpdate as RowUpdate
from optax_sparse_adam._core.rules import CatchUp as CatchUp
from optax_sparse_adam._core.rules import CaughtUp as CaughtUp
from optax_sparse_adam._core.rules import IdleBlock as IdleBlock
from optax_sparse_adam._core.rules import RowBlock as RowBlock
from optax_sparse_adam._core.rules import RowRule as RowRule
from optax_sparse_adam._core.rules import Slot as Slot
from optax_sparse_adam._core.set_rows import SetRowsUpdate as SetRowsUpdate
from optax_sparse_adam._core.sharded.lookup import sharded_lookup as sharded_lookup
from optax_sparse_adam._core.sharded.overflow import (
  RoutingOverflowWarning as RoutingOverflowWarning,
)
from optax_sparse_adam._core.sharded.overflow import RoutingStats as RoutingStats
from optax_sparse_adam._core.sharded.overflow import routing_stats as routing_stats
from optax_sparse_adam._core.sharded.placement import from_cyclic_rows as from_cyclic_rows
from optax_sparse_adam._core.sharded.placement import to_cyclic_rows as to_cyclic_rows
from optax_sparse_adam._core.sharded.routed import sharded_routing as sharded_routing
from optax_sparse_adam._optax.apply import apply_updates as apply_updates
from optax_sparse_adam._optax.catch_up import catch_up_all_rows as catch_up_all_rows
from optax_sparse_adam._optax.catch_up import catch_up_rows as catch_up_rows
from optax_sparse_adam._optax.checks import check_sparse_grads as check_sparse_grads
from optax_sparse_adam._optax.checks import sparse_grad_checks as sparse_grad_checks
from optax_sparse_adam._optax.composition import lift_to_bcoo as lift_to_bcoo
from optax_sparse_adam._optax.composition import on_dense_shapes as on_dense_shapes
from optax_sparse_adam._optax.composition import sparse_apply_if_finite as sparse_apply_if_finite
from optax_sparse_adam._optax.deltas import RowsDelta as RowsDelta
from optax_sparse_adam._optax.deltas import apply_rows_delta as apply_rows_delta
from optax_sparse_adam._optax.deltas import changed_rows as changed_rows
from optax_sparse_adam._optax.deltas import rows_delta as rows_delta
from optax_sparse_adam._optax.leaf import sparse_adam_leaf_step as sparse_adam_leaf_step
from optax_sparse_adam._optax.multi_steps import RowBuffer as RowBuffer
from optax_sparse_adam._optax.multi_steps import SparseMultiStepsState as SparseMultiStepsState
from optax_sparse_adam._optax.multi_steps import sparse_multi_steps as sparse_multi_steps
from optax_sparse_adam._optax.optimizers import sparse_adagrad as sparse_adagrad
from optax_sparse_adam._optax.optimizers import sparse_ftrl as sparse_ftrl
from optax_sparse_adam._optax.optimizers import sparse_rowwise_adagrad as sparse_rowwise_adagrad
from optax_sparse_adam._optax.optimizers import sparse_sgd as sparse_sgd
from optax_sparse_adam._optax.param_ema import ParamEMAState as ParamEMAState
from optax_sparse_adam._optax.param_ema import ema_params as ema_params
from optax_sparse_adam._optax.param_ema import sparse_param_ema as sparse_param_ema
from optax_sparse_adam._optax.reset import reset_rows as reset_rows
from optax_sparse_adam._optax.rule_transform import SparseRuleState as SparseRuleState
from optax_sparse_adam._optax.rule_transform import (
  sparse_rule_transformation as sparse_rule_transformation,
)
from optax_sparse_adam._optax.state import SparseAdamState as SparseAdamState
from optax_sparse_adam._optax.transform import sparse_adam as sparse_adam
from optax_sparse_adam._optax.transform import sparse_adamw as sparse_adamw
from optax_sparse_adam._version import __version__ as __version__

__all__ = (
  "AdagradHyperparams",
  "AdagradRule",
  "AdamCoefficients",
  "CatchUp",
  "CaughtUp",
  "DensifyingUpdateWarning",
  "FtrlHyperparams",
  "FtrlRule",
  "HugePageAdvice",
  "IdleBlock",
  "LeafState",
  "ParamEMAState",
  "RaggedIdsWarning",
  "RoutingOverflowWarning",
  "RoutingStats",
  "RowBlock",
  "RowBuffer",
  "RowRule",
  "RowUpdate",
  "RowsDelta",
  "RowwiseAdagradHyperparams",
  "RowwiseAdagradRule",
  "SGDHyperparams",
  "SGDRule",
  "Slot",
  "SparseAdamState",
  "SparseMultiStepsState",
  "SparseRuleState",
  "SetRowsUpdate",
  "advise_huge_pages",
  "apply_rows_delta",
  "apply_updates",
  "bucket_size",
  "catch_up_all_rows",
  "catch_up_rows",
  "changed_rows",
  "check_sparse_grads",
  "coalesce_rows",
  "ema_params",
  "from_cyclic_rows",
  "cpu_kernels_available",
  "lift_to_bcoo",
  "on_dense_shapes",
  "reset_rows",
  "pad_ids",
  "routing_stats",
  "row_program_report",
  "row_sum",
  "rows_delta",
  "sharded_lookup",
  "sharded_routing",
  "sparse_adagrad",
  "sparse_adam",
  "sparse_adam_leaf_step",
  "sparse_adamw",
  "sparse_apply_if_finite",
  "sparse_ftrl",
  "sparse_grad_checks",
  "sparse_multi_steps",
  "sparse_param_ema",
  "sparse_rowwise_adagrad",
  "sparse_rule_transformation",
  "sparse_sgd",
  "to_cyclic_rows",
  "use_cpu_kernels",
)


# The Flax glue's public names (`optax_sparse_adam.flax.__all__`, which a test checks this equals),
# served from here on first use: flax is an optional extra, so importing this package must not
# import it. They are not in `__all__`, so `from optax_sparse_adam import *` does not either.
_FLAX_NAMES = tuple(
  "LinenSparseEmbed LinenSparseEmbedBag SparseEmbed SparseEmbedBag SparseOptimizer SparseTable "
  "SparseTableBox SparseTrainState embedding_bag_lookup embedding_lookup sparse_grad "
  "sparse_value_and_grad table_labels".split()
)


def __getattr__(name: str) -> object:
  """The Flax glue and its names, on first use: `osa.SparseEmbed` is `osa.flax.SparseEmbed`."""
  if name != "flax" and name not in _FLAX_NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  try:
    flax_glue = importlib.import_module("optax_sparse_adam.flax")
  except ModuleNotFoundError as err:
    if err.name != "flax":
      raise
    raise ModuleNotFoundError(
      f"optax_sparse_adam.{name} is part of the Flax glue, which needs flax: "
      "pip install 'optax_sparse_adam[flax]'.",
      name="flax",
    ) from err
  return flax_glue if name == "flax" else getattr(flax_glue, name)
