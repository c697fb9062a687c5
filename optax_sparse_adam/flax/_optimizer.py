"""Optimizers for the Flax glue: labels for `multi_transform`, and scatter-add application."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state
from jax.experimental import sparse

from optax_sparse_adam._core.errors import flatten_up_to
from optax_sparse_adam._optax import apply
from optax_sparse_adam.flax._tables import SparseTable, SparseTableBox, _is_table_box, _is_variable


def table_labels(tree: Any, *, wrt: Any = nnx.Param) -> Any:
  """Labels every table 'sparse' and every other parameter 'dense', for `optax.multi_transform`.

  Args:
    tree: an NNX module (labels its `wrt` state, tables by `SparseTable`
      type), or a Linen params tree (tables are `SparseTableBox` leaves; BCOO
      leaves are labelled 'sparse' too, so the function itself can be passed
      as `multi_transform`'s label function).
    wrt: NNX only: the filter given to the optimizer (default `nnx.Param`).

  Returns:
    A tree of 'sparse' / 'dense' strings, a prefix of the params and grads.

  Example:
    >>> from flax import nnx
    >>> import optax
    >>> import optax_sparse_adam as osa
    >>> embed = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
    >>> tx = optax.multi_transform(
    ...   {"sparse": osa.sparse_adam(1e-3), "dense": optax.adamw(1e-3)},
    ...   osa.table_labels(embed),
    ... )
    >>> optimizer = osa.SparseOptimizer(embed, tx, wrt=nnx.Param)
  """
  if isinstance(tree, nnx.Pytree):
    tree = nnx.state(tree, wrt)

  def label(x: Any) -> str:
    if isinstance(x, (SparseTable, SparseTableBox, sparse.BCOO)):
      return "sparse"
    return "dense"

  return jax.tree.map(
    label,
    tree,
    is_leaf=lambda x: _is_variable(x) or _is_table_box(x) or isinstance(x, sparse.BCOO),
  )


class SparseOptimizer(nnx.Optimizer):
  """An `nnx.Optimizer` that applies BCOO updates by scatter-add instead of densifying them.

  Same constructor and `update(model, grads)` as `nnx.Optimizer`; the only
  difference is `optax_sparse_adam.apply_updates` in place of
  `optax.apply_updates`. Give it `optax.multi_transform({'sparse':
  sparse_adam(...), 'dense': optax.adamw(...)}, table_labels(model))` and the
  grads of `sparse_value_and_grad`; inside `nnx.jit`, donate the model and the
  optimizer so the tables and moments are updated in place.

  The optax state is held whole by one `nnx.OptState` Variable
  (`optimizer.opt_state`; attribute and item reads reach the state inside it),
  where `nnx.Optimizer` makes a Variable, and a graph node for every container,
  of each leaf: with `multi_transform` that is the masked copy of the params
  tree in every moment of every branch, and `nnx.jit` walks all of it on every
  call. One Variable makes the walk of the optimizer smaller than
  `nnx.Optimizer`'s (docs/flax.md, "Three forms of the step"). If a `wrt`
  Variable carries sharding metadata (`out_sharding`), the state keeps
  `nnx.Optimizer`'s per-leaf Variables, which carry it for
  `nnx.get_partition_spec`.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_sparse_adam as osa
    >>> model = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
    >>> tx = optax.multi_transform(
    ...   {"sparse": osa.sparse_adam(0.1), "dense": optax.adamw(0.1)},
    ...   osa.table_labels(model),
    ... )
    >>> optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)
    >>> def train_step(model, optimizer, ids):
    ...   loss, grads = osa.sparse_value_and_grad(lambda m: (m(ids) ** 2).sum())(model)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> step = nnx.cached_partial(nnx.jit(train_step, donate_argnums=(0, 1)), model, optimizer)
    >>> loss = step(jnp.array([1, 2]))
  """

  def __init__(self, model: Any, tx: Any, *, wrt: Any, graph: bool | None = None) -> None:
    """Creates the optimizer state of `tx` for the `wrt` state of `model`, as `nnx.Optimizer`.

    Args:
      model: the NNX module to optimize.
      tx: the optax transformation.
      wrt: filter of the Variables to update (as `nnx.Optimizer`; typically `nnx.Param`).
      graph: as `nnx.Optimizer`.
    """
    super().__init__(model, tx, wrt=wrt, graph=graph)
    params = jax.tree.leaves(nnx.state(model, wrt, graph=graph), is_leaf=_is_variable)
    if not any(_has_sharding_metadata(variable) for variable in params):
      self.opt_state = nnx.data(nnx.OptState(nnx.as_pure(self.opt_state)))

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> optax.Updates:
    """Updates the optimizer state and the model's parameters from `grads`.

    Args:
      model: the module whose `wrt` state is updated.
      grads: gradients from `sparse_value_and_grad` (or `nnx.grad`).
      **kwargs: extra arguments of `tx.update`.

    Returns:
      The updates (BCOO for tables).
    """
    param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    opt_state_arrays = nnx.as_pure(self.opt_state)
    updates, new_opt_state = self.tx.update(
      grad_arrays, opt_state_arrays, param_arrays, **nnx.as_pure(kwargs)
    )
    new_params = apply.apply_updates(param_arrays, updates)
    nnx.update(model, new_params)
    # Each state Variable gets its new value whole: `nnx.update` would turn a
    # NamedTuple held by one Variable (a sparse_multi_steps RowBuffer) into a State.
    variables, treedef = jax.tree.flatten(self.opt_state, is_leaf=_is_variable)
    values = flatten_up_to(
      treedef,
      new_opt_state,
      lambda: (
        f"SparseOptimizer.update: the transformation returned a state of structure "
        f"{jax.tree.structure(new_opt_state)}, not that of its state {treedef}."
      ),
    )
    for variable, value in zip(variables, values, strict=True):
      variable.set_value(value)
    self.step[...] += 1
    return updates


def _has_sharding_metadata(variable: Any) -> bool:
  """Whether a Variable carries Flax sharding metadata that `nnx.Optimizer` copies to its state."""
  metadata = variable.get_metadata() if _is_variable(variable) else {}
  return any(metadata.get(key) for key in ("out_sharding", "optimizer_sharding"))


class SparseTrainState(train_state.TrainState):
  """A Linen `TrainState` whose `apply_gradients` applies BCOO updates by scatter-add.

  Create it as a `TrainState`, with `LinenSparseEmbed` params (boxed tables)
  and a `tx` such as `optax.multi_transform({'sparse': sparse_adam(...),
  'dense': optax.adamw(...)}, table_labels)`; feed it the grads of
  `sparse_value_and_grad`. Inside `jax.jit`, donate the state.
  """

  @classmethod
  def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> SparseTrainState:
    """Like `TrainState.create`, with `step` an int32 array.

    `TrainState.create` starts `step` as the Python int 0, which makes a jitted
    train step compile twice (int, then array); an array compiles once.
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    return state.replace(step=jnp.zeros([], jnp.int32))

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> SparseTrainState:
    """Returns the state after one optimizer step: `step + 1`, new params and opt_state.

    Args:
      grads: gradients with the structure of `params` (BCOO in the table boxes).
      **kwargs: other fields to `replace`.

    Returns:
      The updated state.
    """
    updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params)
    new_params = apply.apply_updates(self.params, updates)
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)
