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
  run_example.compiles = report["compiles"]
  run_example.adapter = report["adapter"]
  return np.array(report["jax"]), np.array(report["torch"]), report["table_difference"]


@pytest.mark.slow  # the float32 curves' test (default tier) runs the same example
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


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adagrad", marks=pytest.mark.slow)])
def test_one_optimizer_for_every_parameter_on_ragged_bags_is_torchs(optimizer):
  """DLRM's recipe: one torch.optim.SGD (or Adagrad) over tables and MLPs, ragged bags."""
  args = ("--steps", "6", "--ragged", "--optimizer", optimizer, "--lr", "0.1", "--adapter")
  jax_losses, torch_losses, table_difference = run_example(*args)
  np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-12)
  assert table_difference < 1e-12
  # torch_compat's optimizer over the Flax model (tc.named_parameters) and the NNX port.
  assert run_example.adapter == {"losses_equal": True, "params_equal": True}
  # Ids padded to powers of two by osa.pad_ids: 16 bags of 1 to 8 ids hold 16 to 128 ids,
  # at most four sizes (16, 32, 64, 128), whatever the number of steps.
  assert run_example.compiles <= 4


@pytest.mark.slow
def test_sgd_in_float32_over_200_ragged_steps_stays_within_1e6_of_torch():
  args = ("--steps", "200", "--ragged", "--optimizer", "sgd", "--lr", "0.1", "--dtype", "float32")
  jax_losses, torch_losses, _ = run_example(*args, "--adapter")
  assert run_example.adapter == {"losses_equal": True, "params_equal": True}
  assert np.max(np.abs(jax_losses - torch_losses) / np.abs(torch_losses)) < 1e-6
  assert run_example.compiles <= 4  # unpadded: about one compile per step
