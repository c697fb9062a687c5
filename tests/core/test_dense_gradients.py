"""Dense gradient leaves in `sparse_sgd`, `sparse_adagrad` and their torch adapters, against torch.

torch.optim.SGD and torch.optim.Adagrad take dense and sparse gradients alike (only
SparseAdam refuses dense ones): so do these, with torch's dense numbers and options,
in one tree or one optimizer with BCOO leaves. The references are real torch optimizers
run on the same gradients, in float64 (equal to float64 rounding) and float32.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
import optax_sparse_adam.torch_compat as tc
from tests._helpers import tiered

torch = pytest.importorskip("torch")

ROWS, DIM = 6, 3
_RNG = np.random.default_rng(45)
# A table with sparse gradients, a matrix, a vector and a scalar with dense ones.
INIT = {
  "table": _RNG.standard_normal((ROWS, DIM)),
  "w": _RNG.standard_normal((4, DIM)),
  "b": _RNG.standard_normal(DIM),
  "s": np.asarray(_RNG.standard_normal()),
}
STEPS = [
  {
    "ids": np.array([1, 4, 1]),
    "vals": _RNG.standard_normal((3, DIM)),
    **{k: _RNG.standard_normal(np.shape(v)) for k, v in INIT.items() if k != "table"},
  }
  for _ in range(4)
]
DENSE = ("w", "b", "s")


# Options torch takes with a sparse gradient in the same optimizer, and dense-only ones.
SGD_CASES = [
  ({"lr": 0.1}, True),
  ({"lr": 0.1, "maximize": True}, True),
  ({"lr": 0.1, "weight_decay": 0.05}, False),
  ({"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05}, False),
  ({"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}, False),
]
ADAGRAD_CASES = [
  ({"lr": 0.1}, True),
  ({"lr": 0.1, "lr_decay": 0.1, "initial_accumulator_value": 0.2, "eps": 1e-3}, True),
  ({"lr": 0.1, "weight_decay": 0.05, "maximize": True}, False),
]


def _optax_options(options):
  options = dict(options)
  options["learning_rate"] = options.pop("lr")
  return options


DENSE_CASES = [("SGD", o, s) for o, s in SGD_CASES] + [("Adagrad", o, s) for o, s in ADAGRAD_CASES]
# Options another default cell also turns on (plain SGD under maximize, the weight decay under
# momentum, plain Adagrad under lr_decay): the slow tier.
SLOW_DENSE_CASES = (DENSE_CASES[0], DENSE_CASES[2], DENSE_CASES[5])


@pytest.mark.parametrize(
  "name,options,with_sparse",
  tiered(DENSE_CASES, lambda case: case in SLOW_DENSE_CASES),
)
def test_dense_leaves_step_as_torchs_dense_optimizer(name, options, with_sparse):
  # torch refuses the dense-only options on the sparse table: dense leaves only there.
  init = INIT if with_sparse else {k: v for k, v in INIT.items() if k != "table"}
  factory = {"SGD": osa.sparse_sgd, "Adagrad": osa.sparse_adagrad}[name]
  torch_cls = getattr(torch.optim, name)
  with jax.enable_x64(True):
    ours = _optax_run(factory(**_optax_options(options)), init, jnp.float64)
    theirs = _torch_run(torch_cls, options, torch.float64, init)
    for k in init:
      np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-14, atol=1e-15, err_msg=k)
  ours32 = _optax_run(factory(**_optax_options(options)), init, jnp.float32)
  theirs32 = _torch_run(torch_cls, options, torch.float32, init)
  for k in init:  # torch's dense adds fuse a product (an ulp or two apart)
    np.testing.assert_allclose(ours32[k], theirs32[k], rtol=2e-6, atol=2e-7, err_msg=k)
  if name == "SGD" and options.get("momentum"):
    return  # the adapter keeps no momentum buffer (test below)
  adapter = _adapter_run(getattr(tc, name), options, init)
  for k in init:  # the adapter's dense step is the optax step's (its scalars from the host)
    np.testing.assert_allclose(adapter[k], ours32[k], rtol=2.5e-7, atol=1e-8, err_msg=k)


def _torch_run(cls, options, dtype, init):
  params = {k: torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for k, v in init.items()}
  opt = cls(params.values(), **options)
  for step in STEPS:
    if "table" in params:
      params["table"].grad = torch.sparse_coo_tensor(
        torch.tensor(step["ids"][None]), torch.tensor(step["vals"], dtype=dtype), (ROWS, DIM)
      )
    for k in DENSE:
      params[k].grad = torch.tensor(step[k], dtype=dtype)
    opt.step()
  return {k: p.detach().numpy() for k, p in params.items()}


def _optax_run(opt, init, dtype):
  params = {k: jnp.asarray(v, dtype) for k, v in init.items()}
  state = opt.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  for s in STEPS:
    grads = {k: g for k, g in _grads(s, dtype).items() if k in init}
    params, state = step(params, state, grads)
  return {k: np.asarray(v) for k, v in params.items()}


def _adapter_run(cls, options, init):
  params = {k: tc.Parameter(jnp.asarray(v, jnp.float32)) for k, v in init.items()}
  opt = cls(list(params.items()), **options)
  for s in STEPS:
    for k, g in _grads(s, jnp.float32).items():
      if k in params:
        params[k].grad = g
    opt.step()
  return {k: np.asarray(p.data) for k, p in params.items()}


def _grads(step, dtype):
  grads = {k: jnp.asarray(step[k], dtype) for k in DENSE}
  grads["table"] = sparse.BCOO(
    (jnp.asarray(step["vals"], dtype), jnp.asarray(step["ids"][:, None])), shape=(ROWS, DIM)
  )
  return grads


def _mixed_grads(dtype=jnp.float32):
  return _grads(STEPS[0], dtype)


@pytest.mark.parametrize(
  "make,words",
  [
    (lambda: osa.sparse_sgd(0.1, weight_decay=0.1), "add(sparse, dense) is not supported"),
    (lambda: osa.sparse_sgd(0.1, momentum=0.9), "lazy_momentum=True"),
    (lambda: osa.sparse_adagrad(0.1, weight_decay=0.1), "not compatible with sparse gradients"),
  ],
)
def test_what_torch_refuses_on_sparse_gradients_is_refused_naming_the_leaf(make, words):
  opt = make()
  params = {k: jnp.asarray(v, jnp.float32) for k, v in INIT.items()}
  with pytest.raises(ValueError) as info:
    opt.update(_mixed_grads(), opt.init(params), params)
  assert words in str(info.value) and "['table']" in str(info.value)
  # The same optimizer steps the dense leaves alone.
  dense = {k: params[k] for k in DENSE}
  updates, _ = opt.update({k: _mixed_grads()[k] for k in DENSE}, opt.init(dense), dense)
  assert all(
    not isinstance(u, sparse.BCOO) and u.shape == dense[k].shape for k, u in updates.items()
  )


def test_dense_gradients_refused_where_torch_refuses_them_and_of_the_wrong_shape():
  params = {k: jnp.asarray(v, jnp.float32) for k, v in INIT.items()}
  adam = osa.sparse_adam(0.1)
  with pytest.raises(TypeError) as info:
    adam.update(_mixed_grads(), adam.init(params), params)
  message = str(info.value)
  assert "['b']" in message and "SparseEmbedBag" in message and "LinenSparseEmbedBag" in message
  rowwise = osa.sparse_rowwise_adagrad(0.1)
  with pytest.raises(TypeError, match="sparse_adagrad"):
    rowwise.update(_mixed_grads(), rowwise.init(params), params)
  sgd = osa.sparse_sgd(0.1)
  bad = dict(_mixed_grads(), b=jnp.ones(DIM + 1))
  with pytest.raises(ValueError, match=r"dense gradient at \['b'\] has shape \(4,\)"):
    sgd.update(bad, sgd.init(params), params)
  table = tc.Parameter(jnp.zeros((ROWS, DIM)))
  table.grad = jnp.ones((ROWS, DIM))
  with pytest.raises(RuntimeError, match=r"'emb' \(param_groups\[0\]\['params'\]\[0\]\) has a"):
    tc.SparseAdam([("emb", table)]).step()


def test_the_adapter_refuses_momentum_and_sparse_weight_decay_before_any_change():
  named = {k: tc.Parameter(jnp.asarray(v, jnp.float32)) for k, v in INIT.items()}
  for options, words in (
    ({"momentum": 0.9}, "momentum=0.9"),
    ({"weight_decay": 0.1}, "add(sparse, dense)"),
  ):
    opt = tc.SGD(list(named.items()), lr=0.1, **options)
    for k, g in _mixed_grads().items():
      named[k].grad = g
    before = {k: np.asarray(p.data) for k, p in named.items()}
    with pytest.raises(RuntimeError, match=re.escape(words)):
      opt.step()
    for k, p in named.items():
      np.testing.assert_array_equal(np.asarray(p.data), before[k])
  dense = tc.Parameter(jnp.ones(DIM))
  dense.grad = jnp.ones(DIM)
  with pytest.raises(RuntimeError, match="keeps no momentum buffer"):
    tc.SGD([dense], lr=0.1, momentum=0.9).step()
  np.testing.assert_array_equal(np.asarray(dense.data), np.ones(DIM))
