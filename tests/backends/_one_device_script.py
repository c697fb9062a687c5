"""Run by test_one_device.py in a process with 4 CPU devices; prints one JSON object.

For `sparse_adam` (its fused kernel) and `sparse_ftrl` (the generic kernels): a
table committed to one device of the four, stepped under jit with donation,
compiles to the CPU kernels with no table-sized copy and equals the XLA ops bit
for bit; the same table sharded over the four devices compiles to no kernel (a
custom call cannot be partitioned) and equals them too.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.core._forced_devices import force_cpu_devices  # noqa: E402

force_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from optax_sparse_adam._backends import choice  # noqa: E402
from tests._helpers import train_step  # noqa: E402
from tests.backends.test_memory import _table_copies  # noqa: E402

ROWS = 1000  # test_memory's NUM_ROWS: `_table_copies` looks for it
OPTS = {"sparse_adam": lambda: osa.sparse_adam(1e-2), "sparse_ftrl": lambda: osa.sparse_ftrl(0.1)}


def run(opt, place, forced=None):
  """`(hlo, table)`: the compiled step and the table after two steps, placed by `place`."""
  rng = np.random.default_rng(0)
  params = place({"t": jnp.asarray(rng.standard_normal((ROWS, 8)), jnp.float32)})
  state = place(opt.init(params))
  step = jax.jit(train_step(opt), donate_argnums=(0, 1))
  ids = jnp.array([[1], [2], [2], [999], [ROWS]])  # repeated and padding rows
  with choice.choose(forced=forced):
    for k in range(2):
      values = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
      grads = place({"t": sparse.BCOO((values, ids), shape=(ROWS, 8))}, replicated=True)
      if k == 0:
        hlo = step.lower(params, state, grads).compile().as_text()
      params, state = step(params, state, grads)
  return hlo, np.asarray(params["t"]).view(np.uint32)


def main():
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

  def on_device_1(tree, replicated=False):
    return jax.device_put(tree, jax.devices()[1])

  def sharded(tree, replicated=False):
    def put(x):
      spec = P("x") if not replicated and x.ndim and x.shape[0] == ROWS else P()
      return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, tree)

  out = {}
  for name, make in OPTS.items():
    hlo, table = run(make(), on_device_1)
    _, reference = run(make(), on_device_1, forced=choice.GENERIC_XLA)
    sharded_hlo, sharded_table = run(make(), sharded)
    out[name] = {
      "kernels_on_one_device": 'custom_call_target="optax_sparse_adam' in hlo,
      "table_copies": _table_copies(hlo),
      "equal_to_xla_ops": bool(np.array_equal(table, reference)),
      "kernels_when_sharded": 'custom_call_target="optax_sparse_adam' in sharded_hlo,
      "sharded_equal_to_xla_ops": bool(np.array_equal(sharded_table, reference)),
    }
  print(json.dumps(out))


if __name__ == "__main__":
  main()
