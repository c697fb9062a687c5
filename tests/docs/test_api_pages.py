"""The API reference covers every public name, under its public path, and nothing stale."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
PUBLIC_MODULES = ("optax_sparse_adam", "optax_sparse_adam.flax", "optax_sparse_adam.torch_compat")
_ENTRY = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)


def _entries() -> set[str]:
  return {m.group(1) for page in API_PAGES for m in _ENTRY.finditer(page.read_text())}


def _module(name: str):
  if name == "optax_sparse_adam.flax":
    pytest.importorskip("flax")
  return importlib.import_module(name)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_in_all_has_an_api_entry(module_name):
  module = _module(module_name)
  missing = [n for n in module.__all__ if f"{module_name}.{n}" not in _entries()]
  assert not missing, f"{module_name}.__all__ names without a '::: ' entry in docs/api: {missing}"


def test_every_api_entry_is_a_public_name():
  for entry in sorted(_entries()):
    module_name, _, name = entry.rpartition(".")
    assert module_name in PUBLIC_MODULES, f"{entry}: documented under a private path"
    module = _module(module_name)
    assert name in module.__all__, f"{entry} is not in {module_name}.__all__"
    assert getattr(module, name) is not None


def test_the_top_level_flax_names_are_the_documented_ones():
  """`osa.SparseEmbed` and friends are documented once, under `optax_sparse_adam.flax`."""
  pytest.importorskip("flax")
  import optax_sparse_adam as osa
  import optax_sparse_adam.flax as osa_flax

  for name in osa_flax.__all__:
    assert getattr(osa, name) is getattr(osa_flax, name), name
