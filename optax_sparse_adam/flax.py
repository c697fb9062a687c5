"""`optax_sparse_adam.flax`: the Flax glue (needs flax), a re-export of the private `_flax`."""

from optax_sparse_adam._flax import LinenSparseEmbed as LinenSparseEmbed
from optax_sparse_adam._flax import SparseEmbed as SparseEmbed
from optax_sparse_adam._flax import SparseOptimizer as SparseOptimizer
from optax_sparse_adam._flax import SparseTable as SparseTable
from optax_sparse_adam._flax import SparseTableBox as SparseTableBox
from optax_sparse_adam._flax import SparseTrainState as SparseTrainState
from optax_sparse_adam._flax import embedding_lookup as embedding_lookup
from optax_sparse_adam._flax import sparse_grad as sparse_grad
from optax_sparse_adam._flax import sparse_value_and_grad as sparse_value_and_grad
from optax_sparse_adam._flax import table_labels as table_labels
from optax_sparse_adam._flax_bag import LinenSparseEmbedBag as LinenSparseEmbedBag
from optax_sparse_adam._flax_bag import SparseEmbedBag as SparseEmbedBag
from optax_sparse_adam._flax_bag import embedding_bag_lookup as embedding_bag_lookup

__all__ = (
  "LinenSparseEmbed",
  "LinenSparseEmbedBag",
  "SparseEmbed",
  "SparseEmbedBag",
  "SparseOptimizer",
  "SparseTable",
  "SparseTableBox",
  "SparseTrainState",
  "embedding_bag_lookup",
  "embedding_lookup",
  "sparse_grad",
  "sparse_value_and_grad",
  "table_labels",
)
