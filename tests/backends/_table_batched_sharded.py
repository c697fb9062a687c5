"""Run in a subprocess on 2 forced CPU devices: a row-sharded table among local ones.

Prints one JSON object: each leaf's reason to step alone (None: batched), and
whether the step equals the per-table step bit for bit.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.core._forced_devices import force_cpu_devices  # noqa: E402

force_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from optax_sparse_adam._backends import choice  # noqa: E402
from optax_sparse_adam._core.row_rules.adam import AdamRule  # noqa: E402
from optax_sparse_adam._core.rules import StepConfig, Tables  # noqa: E402
from optax_sparse_adam._optax import leaf, table_steps  # noqa: E402


def main():
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  shapes = {"sharded": (40, 8), "a": (30, 8), "b": (20, 4)}
  specs = {"sharded": P("x", None), "a": P(), "b": P()}

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  params = {n: put(rng.standard_normal(s).astype(np.float32), specs[n]) for n, s in shapes.items()}
  grads = {}
  for n, (rows, dim) in shapes.items():
    ids = rng.integers(0, rows, 16)
    ids[1:4] = ids[0]
    ids[-1] = rows + 2
    entries = P("x", None) if n == "sharded" else P()
    grads[n] = sparse.BCOO(
      (
        put(rng.standard_normal((16, dim)).astype(np.float32), entries),
        put(ids[:, None].astype(np.int32), entries),
      ),
      shape=(rows, dim),
    )
  opt = osa.sparse_adam(1e-2)
  results, reasons = [], {}
  with osa.sharded_routing(auto_axis="x"):
    state = opt.init(params)
    for n in shapes:
      ready = leaf.prepare_leaf_step(
        grads[n],
        Tables({"mu": state.mu[n], "nu": state.nu[n]}),
        jnp.int32(0),
        rule=AdamRule(),
        config=StepConfig(),
        path=(n,),
      )
      reasons[n] = table_steps.unbatched_reason(ready)
    for batch in (True, False):
      with choice.choose(forced=choice.ACCELERATOR, batch_tables=batch):

        @jax.jit
        def step(params, state, grads):
          updates, state = opt.update(grads, state, params)
          return osa.apply_updates(params, updates), state

        results.append(jax.tree.leaves(step(params, opt.init(params), grads)))
  same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(*results, strict=True))
  new_params = results[0][: len(shapes)]  # the params' leaves come first, in key order
  moved = [
    not np.array_equal(np.asarray(new), np.asarray(params[n]))
    for n, new in zip(sorted(shapes), new_params, strict=True)
  ]
  print(json.dumps({"reasons": reasons, "same_bits": same, "every_table_moved": all(moved)}))


if __name__ == "__main__":
  main()
