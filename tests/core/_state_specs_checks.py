"""The optimizer state's specs from `optax.tree.map_params`, used as `jax.jit` out_shardings.

Run by tests/core/test_state_specs_sharding.py in a subprocess on 4 forced CPU devices (the
device count is fixed when JAX starts). For each configuration it maps the params' specs
onto the state, initialises the state with `jax.jit(opt.init, out_shardings=...)`, runs
three jitted steps with the state's shardings as in and out shardings, and reports each
state leaf's spec and shard shape, the number of compilations, and the largest difference
from the same steps on one device.

  PYTHONPATH=. python tests/core/_state_specs_checks.py   # prints one JSON object
"""

from tests.core._forced_devices import force_cpu_devices

force_cpu_devices(4)

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

ROWS, DIM, NSE = 64, 8, 12
PARAM_SPECS = {"rows": P("x", None), "cols": P(None, "x"), "bias": P()}


def fit_rank(leaf, spec):
  """The parameter's spec, cut to the state leaf's rank (per-row steps are 1-D)."""
  return P(*tuple(spec)[: jnp.ndim(leaf)])


CONFIGS = {
  "sparse_adam": (lambda: osa.sparse_adam(0.05), "as_is"),
  "sparse_adamw_amsgrad": (
    lambda: osa.sparse_adamw(0.05, weight_decay=0.1, amsgrad=True),
    "as_is",
  ),
  "per_row_bias_correction": (
    lambda: osa.sparse_adam(0.05, per_row_bias_correction=True),
    "fit_rank",
  ),
  "chain_inject_plateau": (
    lambda: optax.chain(
      optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.05),
      osa.lift_to_bcoo(optax.contrib.reduce_on_plateau()),
    ),
    "as_is",
  ),
}


def params_on(devices_put):
  rng = np.random.default_rng(0)
  params = {
    "rows": rng.normal(size=(ROWS, DIM)).astype(np.float32),
    "cols": rng.normal(size=(ROWS, DIM)).astype(np.float32),
    "bias": np.zeros(DIM, np.float32),
  }
  return {k: devices_put(k, jnp.asarray(v)) for k, v in params.items()}


def grads_of(step):
  rng = np.random.default_rng(100 + step)
  out = {}
  for name in ("rows", "cols"):
    ids = rng.integers(0, ROWS, size=NSE).astype(np.int32)
    data = rng.normal(size=(NSE, DIM)).astype(np.float32)
    out[name] = sparse.BCOO((jnp.asarray(data), jnp.asarray(ids[:, None])), shape=(ROWS, DIM))
  out["bias"] = None
  return out


def train(opt, params, state, step_fn):
  for i in range(3):
    params, state = step_fn(params, state, grads_of(i), jnp.float32(3.0 - i))
  return params, state


def make_step(opt):
  def step(params, state, grads, loss):
    updates, state = opt.update(grads, state, params, value=loss)
    return osa.apply_updates(params, updates), state

  return step


def run(mesh, name):
  make, how = CONFIGS[name]
  opt = make()
  fn = fit_rank if how == "fit_rank" else (lambda _, spec: spec)
  params = params_on(lambda k, v: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[k])))
  abstract = jax.eval_shape(opt.init, params)
  specs = optax.tree.map_params(opt, fn, abstract, PARAM_SPECS, transform_non_params=lambda _: P())
  is_spec = lambda x: isinstance(x, P)  # noqa: E731
  state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
  param_shardings = {k: NamedSharding(mesh, s) for k, s in PARAM_SPECS.items()}
  state = jax.jit(opt.init, out_shardings=state_shardings)(params)
  init_specs = [str(x.sharding.spec) for x in jax.tree.leaves(state)]
  step = jax.jit(
    make_step(opt),
    in_shardings=(param_shardings, state_shardings, None, None),
    out_shardings=(param_shardings, state_shardings),
    donate_argnums=(0, 1),
  )
  params, state = train(opt, params, state, step)

  ref_opt = make()
  ref_params = params_on(lambda k, v: v)
  ref_params, ref_state = train(
    ref_opt, ref_params, ref_opt.init(ref_params), jax.jit(make_step(ref_opt))
  )
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
  diffs = [
    float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
    for a, b in zip(
      jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state)), strict=True
    )
  ]
  return {
    "leaves": [
      {
        "path": jax.tree_util.keystr(path),
        "shape": list(leaf.shape),
        "mapped_spec": str(spec),
        "mapped_rank": len(spec),
        "spec": str(leaf.sharding.spec),
        "shard_shape": list(leaf.sharding.shard_shape(leaf.shape)),
      }
      for (path, leaf), spec in zip(leaves, spec_leaves, strict=True)
    ],
    "init_specs": init_specs,
    "compilations": step._cache_size(),
    "max_abs_diff": max(diffs),
  }


def main():
  mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
  result = {"num_devices": jax.device_count(), "runs": {}}
  for name in CONFIGS:
    result["runs"][name] = run(mesh, name)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
