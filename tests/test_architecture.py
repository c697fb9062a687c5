"""The layers of docs/architecture.md, checked by reading every module's imports."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "optax_sparse_adam"
# The layers, bottom first: a module may import its own layer and the ones below,
# never one above. Front ends share a rank and never import each other.
LAYERS = {"_core": 0, "_backends": 1, "_optax": 2, "flax": 3, "torch_compat": 3}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
  """The package's modules that `name` imports, anywhere in its source (functions too)."""
  found = set()
  package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(MODULES[name].read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
        base = base.rstrip(".")
      # `from pkg import module` imports the module; `from pkg import name`, the package.
      targets = [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
        for alias in node.names
      ]
    else:
      continue
    for target in targets:
      while target and target not in MODULES:
        target = target.rpartition(".")[0]
      if target.startswith("optax_sparse_adam.") and target != name:
        found.add(target)
  return found


GRAPH = {name: _imports(name) for name in MODULES}


def _in(name: str, layer: str) -> bool:
  return name == f"optax_sparse_adam.{layer}" or name.startswith(f"optax_sparse_adam.{layer}.")


def _layer(name: str) -> str | None:
  return next((layer for layer in LAYERS if _in(name, layer)), None)


def _violations(source_layer: str, forbidden) -> list[str]:
  return [
    f"{name} imports {target}"
    for name, targets in GRAPH.items()
    if _in(name, source_layer)
    for target in sorted(targets)
    if forbidden(target)
  ]


def test_the_reader_sees_every_layer():
  """A control: the import reader finds the edges the rules are about."""
  assert "optax_sparse_adam._backends.dispatch" in GRAPH["optax_sparse_adam._optax.leaf"]
  assert "optax_sparse_adam._core.coalesce" in GRAPH["optax_sparse_adam._backends.xla"]
  assert "optax_sparse_adam._optax.leaf" in GRAPH["optax_sparse_adam.torch_compat._step"]
  assert "optax_sparse_adam.flax._tables" in GRAPH["optax_sparse_adam.flax._grads"]
  assert {_layer(name) for name in MODULES} >= set(LAYERS)


def test_every_module_is_in_a_layer():
  outside = {"optax_sparse_adam", "optax_sparse_adam._version"}
  assert [name for name in MODULES if _layer(name) is None and name not in outside] == []


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_point_one_way(layer):
  def above(target: str) -> bool:
    other = _layer(target)
    return other is not None and other != layer and LAYERS[other] >= LAYERS[layer]

  assert _violations(layer, above) == []


@pytest.mark.parametrize("front", ["flax", "torch_compat"])
def test_front_ends_reach_the_backends_only_through_the_optax_layer(front):
  assert _violations(front, lambda t: _in(t, "_backends")) == []


def test_the_optax_layer_calls_the_backends_only_through_dispatch():
  assert (
    _violations(
      "_optax", lambda t: _in(t, "_backends") and t != "optax_sparse_adam._backends.dispatch"
    )
    == []
  )


def test_the_bottom_layer_does_not_know_its_backend():
  for name, path in MODULES.items():
    if _in(name, "_core"):
      assert "platform_dependent" not in path.read_text(), name


def test_no_import_cycles():
  state: dict[str, str] = {}

  def visit(name: str, trail: tuple[str, ...]) -> None:
    state[name] = "open"
    for target in sorted(GRAPH[name]):
      if target.endswith("__init__") or MODULES[target].name == "__init__.py":
        continue  # a package's face re-exports; it is not a layer
      assert state.get(target) != "open", f"cycle: {' -> '.join(trail + (target,))}"
      if target not in state:
        visit(target, trail + (target,))
    state[name] = "done"

  for name in GRAPH:
    if name not in state and MODULES[name].name != "__init__.py":
      visit(name, (name,))


def test_modules_stay_small():
  sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
  assert {name: n for name, n in sizes.items() if n > 500} == {}
