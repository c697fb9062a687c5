"""Each example's Gallery block is true to its script, feeds the docs page, and names its extras.

The block (examples/_gallery.py) is the one source of an example's extras, what it shows
and its run time: the docs hook renders it, and the script reads it to check its extras.
"""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str, path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


gallery = _load("_gallery", EXAMPLES / "_gallery.py")
METAS = gallery.all_examples(EXAMPLES)
BY_NAME = {meta.name: meta for meta in METAS}


def _imported_modules(path: pathlib.Path) -> tuple[set[str], set[str]]:
  """Top-level packages imported at module level, and those imported anywhere else."""
  tree = ast.parse(path.read_text())
  top, nested = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = {node.module.split(".")[0]}
    else:
      continue
    (top if node in tree.body else nested).update(names)
  return top, nested


def test_every_example_script_has_a_gallery_entry():
  scripts = {p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
  assert set(BY_NAME) == scripts - {"recsys_data"}  # recsys_data: shared data, not an example
  assert len({meta.title for meta in METAS}) == len(METAS), "titles must be unique"


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_extras_match_the_scripts_imports(name):
  meta = BY_NAME[name]
  top, nested = _imported_modules(EXAMPLES / f"{name}.py")
  for extra, module in gallery.EXTRA_MODULES.items():
    root = module.split(".")[0]
    if root in top:
      assert extra in meta.extras, f"{name} imports {module} at the top but lacks [{extra}]"
    elif root in nested:
      assert extra in meta.extras + meta.optional_extras, f"{name}: [{extra}] not listed"
    else:
      assert extra not in meta.extras + meta.optional_extras, f"{name} never imports {module}"


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_run_time_is_a_measurement_with_its_place(name):
  run_time = BY_NAME[name].run_time
  assert re.match(r"^\d+(\.\d+)? s\b", run_time), run_time
  assert "measured" in run_time or "CPU" in run_time, f"{name}: say where it was measured"


def test_the_docs_page_renders_every_entry():
  hooks = _load("docs_hooks", ROOT / "docs" / "hooks.py")
  page = hooks.gallery_markdown()
  for meta in METAS:
    assert f"## {meta.title}" in page
    assert f"python examples/{meta.name}.py" in page
    assert meta.run_time in page and meta.shows in page
    assert gallery.install_command(meta.extras) in page
  assert "<!-- gallery -->" in (ROOT / "docs" / "examples.md").read_text()


MISSING = [(meta.name, extra) for meta in METAS for extra in meta.extras]


@pytest.mark.parametrize("name, extra", MISSING, ids=[f"{n}-without-{e}" for n, e in MISSING])
def test_an_example_without_its_extra_says_what_to_install(name, extra):
  module = gallery.EXTRA_MODULES[extra]
  script = EXAMPLES / f"{name}.py"
  # None in sys.modules makes `import module` fail as if it were not installed.
  code = (
    f"import runpy, sys; sys.modules[{module!r}] = None; sys.path.insert(0, {str(EXAMPLES)!r}); "
    f"sys.argv = [{str(script)!r}]; runpy.run_path({str(script)!r}, run_name='__main__')"
  )
  result = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
  )
  assert result.returncode == 1, result.stderr
  assert f"needs the [{extra}] extra" in result.stderr, result.stderr
  assert gallery.install_command(BY_NAME[name].extras) in result.stderr, result.stderr
  assert "Traceback" not in result.stderr, result.stderr
