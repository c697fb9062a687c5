"""Packaging a user can trust: one version, the license declared and shipped, py.typed, and a
README whose commands are the ones CI runs."""

import pathlib
import re
import tomllib

import optax_sparse_adam as osa
from optax_sparse_adam import _version

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()


def test_one_source_for_the_version():
  assert osa.__version__ == _version.__version__
  assert re.fullmatch(r"\d+\.\d+\.\d+", osa.__version__)
  assert "version" not in PYPROJECT["project"]
  assert "version" in PYPROJECT["project"]["dynamic"]
  dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
  assert dynamic == {"attr": "optax_sparse_adam._version.__version__"}
  assigned = [
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "optax_sparse_adam").rglob("*.py")
    if re.search(r"^__version__\s*=", p.read_text(), re.MULTILINE)
  ]
  assert assigned == ["optax_sparse_adam/_version.py"], assigned


def test_the_license_file_matches_pyproject():
  assert PYPROJECT["project"]["license"] == "Apache-2.0"
  assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_py_typed_is_package_data():
  assert (ROOT / "optax_sparse_adam" / "py.typed").is_file()
  assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["optax_sparse_adam"]


def test_docs_and_build_are_in_the_extras_with_version_ranges():
  extras = PYPROJECT["project"]["optional-dependencies"]
  docs = {re.split(r"[\[<>=]", req)[0]: req for req in extras["docs"]}
  # latex2mathml: the docstrings' math, as MathML at build time (docs/griffe_examples.py).
  assert set(docs) == {"mkdocs", "mkdocs-material", "mkdocstrings", "latex2mathml"}, docs
  for req in docs.values():
    assert ">=" in req and "<" in req, f"{req}: give a version range"
  assert "mkdocstrings[python]" in docs["mkdocstrings"]
  assert any(req.startswith("build") for req in extras["test"])


def test_readme_is_short():
  assert len(README.encode()) <= 8 * 1024, len(README.encode())


def test_the_readme_test_command_is_what_ci_runs():
  torch_pin = re.search(r"pip install -q (torch==[\d.]+)", CI).group(1)
  extras = re.search(r'pip install -q -e "(\.\[[\w,]+\])"', CI).group(1)
  assert "\nOPTAX_SPARSE_ADAM_REQUIRE_CPU_KERNELS=1 python -m pytest -q\n" in CI
  command = (
    f"python3 -m venv .venv && . .venv/bin/activate && pip install {torch_pin} && "
    f'pip install -e "{extras}" && python -m pytest -q'
  )
  assert command in README, f"the README's test command should read: {command}"


def test_ci_builds_the_docs_strictly_and_smoke_tests_the_installed_wheel():
  assert "mkdocs build --strict" in CI
  assert "python -m build" in CI
  assert re.search(r"venv/bin/python\" -m pip install -q \"\$out\"/dist/.*\.whl", CI)
  assert ".ci/smoke_wheel.py" in CI
