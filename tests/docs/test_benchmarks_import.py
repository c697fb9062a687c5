"""Every benchmark script imports: one reaching for a helper another script renamed fails here."""

import importlib
import os
from pathlib import Path

import pytest

BENCHMARKS = sorted(
  path.stem
  for path in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
  if path.stem != "__init__"
)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_script_imports(name, monkeypatch):
  # bench_sharded asks for 8 forced devices in XLA_FLAGS at import; kept from a JAX
  # backend not yet started, that would give this test process 8 devices.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  module = importlib.import_module(f"benchmarks.{name}")
  if not name.startswith("_"):  # a script: run as `python -m benchmarks.<name>`
    assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
