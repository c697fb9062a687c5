"""Checks on forced CPU devices, run in a subprocess: the script's preamble and the test's runner.

JAX fixes the device count when it starts, so a check that needs several devices
runs in a fresh interpreter (the other tests keep their single device). Such a
script calls `force_cpu_devices(n)` before it imports JAX and prints one JSON
object; its test module reads it with `run_checks(script)`. This module imports
nothing that starts JAX.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def force_cpu_devices(count: int) -> None:
  """Makes JAX, when it starts, run on the CPU with `count` host devices.

  Call before `jax` is first imported: the flag is read once, when the backend starts.
  """
  if "jax" in sys.modules:
    raise RuntimeError("force_cpu_devices must run before jax is imported")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
  ).strip()
  os.environ["JAX_PLATFORMS"] = "cpu"


def run_checks(script: str, *args: str, timeout: float = 600) -> Any:
  """Runs `tests/core/<script> *args` in a fresh interpreter and returns the JSON it prints."""
  done = subprocess.run(
    [sys.executable, str(ROOT / "tests" / "core" / script), *args],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    timeout=timeout,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout)
