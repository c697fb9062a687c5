"""Drop-in `torch.optim.SparseAdam`, `SGD` and `Adagrad` for JAX arrays, for porting recipes.

    from optax_sparse_adam.torch_compat import Parameter, SparseAdam

    table = Parameter(jnp.zeros((num_embeddings, dim)))
    opt = SparseAdam([table], lr=1e-3)
    table.grad = bcoo_grad          # a jax.experimental.sparse.BCOO
    opt.step()                       # rebinds table.data
    opt.zero_grad()

It has the behaviour of `torch.optim.SparseAdam` and `torch.optim.Optimizer`:
param groups, `state_dict`/`load_state_dict` in torch's layout (checkpoints move
both ways between torch and JAX), hooks, `zero_grad`, and bit-for-bit torch's
float32 numerics. The arithmetic is the library's one implementation
(`optax_sparse_adam.sparse_adam_leaf_step`). torch is optional: where it is
installed, it is imported with this module and `SparseAdam` is also a
`torch.optim.Optimizer` (so torch's lr schedulers accept it); where it is not,
everything but the torch checkpoint functions works without it.
"""

from optax_sparse_adam.torch_compat._adagrad import Adagrad as Adagrad
from optax_sparse_adam.torch_compat._bridge import named_parameters as named_parameters
from optax_sparse_adam.torch_compat._bridge import parameters_tree as parameters_tree
from optax_sparse_adam.torch_compat._bridge import set_grads as set_grads
from optax_sparse_adam.torch_compat._convert import load_torch_checkpoint as load_torch_checkpoint
from optax_sparse_adam.torch_compat._convert import save_torch_checkpoint as save_torch_checkpoint
from optax_sparse_adam.torch_compat._convert import state_dict_to_torch as state_dict_to_torch
from optax_sparse_adam.torch_compat._hooks import RemovableHandle as RemovableHandle
from optax_sparse_adam.torch_compat._optimizer import Optimizer as Optimizer
from optax_sparse_adam.torch_compat._parameter import Parameter as Parameter
from optax_sparse_adam.torch_compat._sgd import SGD as SGD
from optax_sparse_adam.torch_compat._sparse_adam import SparseAdam as SparseAdam

__all__ = (
  "Adagrad",
  "Optimizer",
  "Parameter",
  "RemovableHandle",
  "SGD",
  "SparseAdam",
  "load_torch_checkpoint",
  "named_parameters",
  "parameters_tree",
  "save_torch_checkpoint",
  "set_grads",
  "state_dict_to_torch",
)
