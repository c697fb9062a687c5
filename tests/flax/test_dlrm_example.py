"""examples/dlrm_side_by_side.py on a tiny setting: the JAX and torch loss curves agree.

Run as a subprocess: the example turns on float64 (jax_enable_x64), which must not
leak into the other tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("flax")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--batch-size", "16", "--rows", "60", "25", "--dim", "4", "--hidden", "8"]


def run_example(*args):
  done = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "dlrm_side_by_side.py"), *TINY, *args, "--json"],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  return np.array(report["jax"]), np.array(report["torch"]), report["table_difference"]


def test_float64_curves_are_the_same_curve():
  jax_losses, torch_losses, table_difference = run_example("--steps", "25")
  assert len(jax_losses) == len(torch_losses) == 25
  np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-10)
  assert table_difference < 1e-10
  assert jax_losses[-5:].mean() < jax_losses[:5].mean()  # it trains


def test_float32_curves_agree_to_rounding_over_the_first_steps():
  jax_losses, torch_losses, table_difference = run_example("--steps", "3", "--dtype", "float32")
  np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-5)
  assert table_difference < 1e-5
