"""examples/train_embedding.py, the README's main example, run as a user runs it.

Subprocesses with small tables and few steps: the default float32 tables, and 16-bit
tables with each `--param-rounding` (docs/memory.md quotes its full runs).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_embedding.py"
SMALL = ["--users", "2000", "--items", "500", "--dim", "8", "--batch", "256", "--steps", "40"]


@pytest.mark.slow  # a subprocess per run; the default tier runs no example
@pytest.mark.parametrize(
  "flags",
  [
    [],
    ["--table-dtype", "bfloat16"],
    ["--table-dtype", "float16", "--param-rounding", "stochastic"],
  ],
  ids=["float32", "bf16-nearest", "f16-stochastic"],
)
def test_the_main_example_trains_and_prints_its_held_out_rmse(flags):
  done = subprocess.run(
    [sys.executable, str(SCRIPT), *SMALL, "--lr", "0.05", *flags],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  dtype = flags[1] if flags else "float32"
  assert f"({dtype}, param_rounding=" in done.stdout
  found = re.search(r"held-out RMSE ([0-9.]+) \(predicting the mean: ([0-9.]+)\)", done.stdout)
  assert found, done.stdout
  rmse, baseline = map(float, found.groups())
  assert rmse < baseline  # 40 steps learn something about the planted factors
  assert "per-table steps taken: 40" in done.stdout
