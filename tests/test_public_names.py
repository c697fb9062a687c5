"""The public names stay where users find them: every name the README, docs and examples use."""

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import optax_sparse_adam as osa

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMESPACES = ("optax_sparse_adam", "optax_sparse_adam.flax", "optax_sparse_adam.torch_compat")
# The public names of 0.1.0: moving modules must not move or drop any of them.
RELEASED = {
  "optax_sparse_adam": {
    "AdamCoefficients",
    "HugePageAdvice",
    "LeafState",
    "RowBuffer",
    "SparseAdamState",
    "SparseMultiStepsState",
    "advise_huge_pages",
    "apply_updates",
    "check_sparse_grads",
    "coalesce_rows",
    "cpu_kernels_available",
    "lift_to_bcoo",
    "sparse_adam",
    "sparse_adam_leaf_step",
    "sparse_adamw",
    "sparse_apply_if_finite",
    "sparse_grad_checks",
    "sparse_multi_steps",
    "use_cpu_kernels",
  },
  "optax_sparse_adam.flax": {
    "LinenSparseEmbed",
    "SparseEmbed",
    "SparseOptimizer",
    "SparseTable",
    "SparseTableBox",
    "SparseTrainState",
    "embedding_lookup",
    "sparse_grad",
    "sparse_value_and_grad",
    "table_labels",
  },
  "optax_sparse_adam.torch_compat": {
    "Optimizer",
    "Parameter",
    "RemovableHandle",
    "SparseAdam",
    "load_torch_checkpoint",
    "save_torch_checkpoint",
    "state_dict_to_torch",
  },
}


def _texts():
  paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  paths += sorted((ROOT / "examples").glob("*.py"))
  return {p.relative_to(ROOT): p.read_text() for p in paths if p.exists()}


def _used_names():
  """(namespace, name, file) for `osa.X` and `from optax_sparse_adam[.ns] import X, ...`."""
  used = set()
  for path, text in _texts().items():
    for name in re.findall(r"\bosa\.([A-Za-z_]\w*)", text):
      used.add(("optax_sparse_adam", name, str(path)))
    pattern = r"from (optax_sparse_adam(?:\.\w+)?) import (?:\(([^)]*)\)|([^\n]*))"
    for module, in_parens, on_line in re.findall(pattern, text):
      for item in (in_parens or on_line).split("#")[0].split(","):
        name = item.split(" as ")[0].strip()
        if name and not name.startswith("_"):
          used.add((module, name, str(path)))
  return sorted(used)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_released_names_are_exported(namespace):
  pytest.importorskip("flax") if namespace.endswith("flax") else None
  module = importlib.import_module(namespace)
  missing = RELEASED[namespace] - set(module.__all__)
  assert missing == set()
  for name in module.__all__:
    assert getattr(module, name) is not None


def test_the_flax_names_load_lazily_from_the_top_level():
  pytest.importorskip("flax")
  for name in RELEASED["optax_sparse_adam.flax"]:
    assert getattr(osa, name) is getattr(osa.flax, name)
  assert not set(osa.__all__) & RELEASED["optax_sparse_adam.flax"]  # `import *` needs no flax


def test_the_lazy_flax_names_are_the_flax_glues_all():
  """The top level's list of lazily served names is the glue's `__all__`, nothing more or less."""
  pytest.importorskip("flax")
  assert osa._FLAX_NAMES == osa.flax.__all__


def test_importing_the_package_does_not_import_flax():
  code = (
    "import sys, optax_sparse_adam; from optax_sparse_adam import *; "
    "print(sorted(m for m in sys.modules "
    "if m == 'flax' or m.startswith(('flax.', 'optax_sparse_adam.flax'))))"
  )
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  assert out.stdout.strip() == "[]"


def test_every_name_the_docs_use_exists():
  used = _used_names()
  assert len(used) > 20  # a control: the scan finds the names
  needs_flax = {"optax_sparse_adam.flax"}
  missing = []
  for module, name, path in used:
    if module in needs_flax or (module == "optax_sparse_adam" and name in osa._FLAX_NAMES):
      pytest.importorskip("flax")
    if not hasattr(importlib.import_module(module), name):
      missing.append(f"{module}.{name} (used in {path})")
  assert missing == []
