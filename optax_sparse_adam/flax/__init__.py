"""`optax_sparse_adam.flax`: the Flax glue (needs flax).

Tables with BCOO gradients (`SparseEmbed` for NNX, `LinenSparseEmbed` for
Linen, both with torch's `nn.Embedding` options; the bags `SparseEmbedBag` and
`LinenSparseEmbedBag`, torch's `nn.EmbeddingBag`), the transform that gives
them (`sparse_value_and_grad`), and the optimizers that apply BCOO updates by
scatter-add (`SparseOptimizer`, `SparseTrainState`).
"""

from optax_sparse_adam.flax._bag import LinenSparseEmbedBag as LinenSparseEmbedBag
from optax_sparse_adam.flax._bag import SparseEmbedBag as SparseEmbedBag
from optax_sparse_adam.flax._bag import embedding_bag_lookup as embedding_bag_lookup
from optax_sparse_adam.flax._grads import sparse_grad as sparse_grad
from optax_sparse_adam.flax._grads import sparse_value_and_grad as sparse_value_and_grad
from optax_sparse_adam.flax._linen import LinenSparseEmbed as LinenSparseEmbed
from optax_sparse_adam.flax._nnx import SparseEmbed as SparseEmbed
from optax_sparse_adam.flax._optimizer import SparseOptimizer as SparseOptimizer
from optax_sparse_adam.flax._optimizer import SparseTrainState as SparseTrainState
from optax_sparse_adam.flax._optimizer import table_labels as table_labels
from optax_sparse_adam.flax._tables import SparseTable as SparseTable
from optax_sparse_adam.flax._tables import SparseTableBox as SparseTableBox
from optax_sparse_adam.flax._tables import embedding_lookup as embedding_lookup

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
