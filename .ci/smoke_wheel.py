"""Smoke test of an installed wheel (run from outside the checkout, in a fresh venv).

Checks what an editable install cannot: that the package data shipped. Run by .ci/run.
"""

import importlib.metadata
import pathlib
import sys

import jax.numpy as jnp
from jax.experimental import sparse

import optax_sparse_adam as osa

package_dir = pathlib.Path(osa.__file__).parent
assert "site-packages" in str(package_dir), f"imported from {package_dir}, not an installed wheel"
assert osa.__version__ == importlib.metadata.version("optax_sparse_adam"), osa.__version__
assert (package_dir / "py.typed").is_file(), "py.typed is missing from the wheel"
license_files = [f for f in importlib.metadata.files("optax_sparse_adam") if f.name == "LICENSE"]
assert license_files, "LICENSE is missing from the wheel's metadata"

params = {"table": jnp.zeros((8, 2))}
opt = osa.sparse_adam(0.1)
state = opt.init(params)
grad = sparse.BCOO((jnp.ones((1, 2)), jnp.array([[3]])), shape=(8, 2))
updates, state = opt.update({"table": grad}, state, params)
params = osa.apply_updates(params, updates)
changed = sorted({int(r) for r in jnp.nonzero(params["table"])[0]})
assert changed == [3], changed  # only the touched row moved, by -lr
assert jnp.allclose(params["table"][3], -0.1), params["table"][3]

# A rule of the generic transformation too (on the CPU, rule_kernels.cc's kernel where built).
adagrad = osa.sparse_adagrad(0.1)
updates, _ = adagrad.update({"table": grad}, adagrad.init(params), params)
assert jnp.allclose(updates["table"].data, -0.1), updates["table"].data  # -lr * g / sqrt(g^2)

require_kernels = "--require-cpu-kernels" in sys.argv
if require_kernels:
  assert osa.cpu_kernels_available(), "the CPU kernels were not built into the wheel"
print(
  f"wheel OK: optax_sparse_adam {osa.__version__} from {package_dir}, py.typed, LICENSE, "
  f"one step; CPU kernels {'built' if osa.cpu_kernels_available() else 'not built'}"
)
