"""The training step the tests run: `opt.update`, then `osa.apply_updates`."""

import optax

import optax_sparse_adam as osa


def train_step(opt: optax.GradientTransformation):
  """`step(params, state, grads) -> (params, state)` for `opt`; jit and donate it as needed."""

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  return step
