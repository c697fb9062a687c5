"""`save_torch_checkpoint` is crash-safe: a writer killed mid-save leaves the last checkpoint.

A subprocess starts a large save over an existing checkpoint and is SIGKILLed
while its temporary file is growing. The previous checkpoint still loads, and
training resumed from it equals an uninterrupted run bit for bit.
"""

import glob
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import (
  Parameter,
  SparseAdam,
  load_torch_checkpoint,
  save_torch_checkpoint,
)

torch = pytest.importorskip("torch")

SHAPE = (64, 8)
STEPS, SAVED_AT = 10, 4

# A training process saving a big table's checkpoint (3 x 100 MB) over `path`.
_BIG_WRITER = textwrap.dedent(
  """
  import sys
  import jax.numpy as jnp
  from jax.experimental import sparse
  from optax_sparse_adam.torch_compat import Parameter, SparseAdam, save_torch_checkpoint

  table = Parameter(jnp.ones((200_000, 128)))
  opt = SparseAdam([table], lr=0.1)
  table.grad = sparse.BCOO((jnp.ones((2, 128)), jnp.array([[0], [5]])), shape=table.shape)
  opt.step()
  print("saving", flush=True)
  checkpoint = {"params": {"table": table.data}, "optimizer": opt.state_dict()}
  save_torch_checkpoint(checkpoint, sys.argv[1])
  print("saved", flush=True)
  """
)


def _grad(step):
  rng = np.random.default_rng(step)
  rows = rng.integers(0, SHAPE[0], size=12)
  values = rng.normal(size=(12, SHAPE[1])).astype(np.float32)
  return sparse.BCOO((jnp.asarray(values), jnp.asarray(rows[:, None])), shape=SHAPE)


def _train(param, opt, steps):
  for step in steps:
    param.grad = _grad(step)
    opt.step()


def _fresh():
  param = Parameter(jnp.asarray(np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)))
  return param, SparseAdam([param], lr=0.05)


def _read(path):
  with open(path, "rb") as file:
    return file.read()


def _kill_mid_write(path):
  """Runs the big writer over `path` and SIGKILLs it while its temporary file grows."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  writer = subprocess.Popen(
    [sys.executable, "-c", _BIG_WRITER, str(path)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    env=env,
  )
  pattern = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.*.tmp")
  deadline = time.monotonic() + 300
  try:
    last_size = 0
    while time.monotonic() < deadline and writer.poll() is None:
      sizes = [os.path.getsize(f) for f in glob.glob(pattern) if os.path.exists(f)]
      size = max(sizes, default=0)
      if last_size > 0 and size > last_size:  # exists and is growing: mid-write
        os.kill(writer.pid, signal.SIGKILL)
        break
      last_size = size
      time.sleep(0.001)
  finally:
    if writer.poll() is None and time.monotonic() >= deadline:
      writer.kill()
    _, stderr = writer.communicate()
  assert writer.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
  return glob.glob(pattern)


def test_killed_save_leaves_the_previous_checkpoint_and_resume_is_bit_exact(tmp_path):
  path = str(tmp_path / "ckpt.pt")

  param, opt = _fresh()
  _train(param, opt, range(STEPS))
  uninterrupted = np.asarray(param.data)

  param, opt = _fresh()
  _train(param, opt, range(SAVED_AT))
  save_torch_checkpoint({"params": {"table": param.data}, "optimizer": opt.state_dict()}, path)
  saved_bytes = _read(path)

  leftovers = _kill_mid_write(path)

  # The kill landed mid-write: the writer's temporary file is there, truncated.
  assert leftovers, "the writer left no temporary file"
  for leftover in leftovers:
    with pytest.raises(Exception):  # noqa: B017 - any reader error shows the truncation
      torch.load(leftover, weights_only=True)
  # The target is untouched, byte for byte, and loads.
  assert _read(path) == saved_bytes
  checkpoint = load_torch_checkpoint(path)

  param = Parameter(checkpoint["params"]["table"])
  opt = SparseAdam([param], lr=0.05)
  opt.load_state_dict(checkpoint["optimizer"])
  _train(param, opt, range(SAVED_AT, STEPS))
  np.testing.assert_array_equal(np.asarray(param.data), uninterrupted)


def test_save_replaces_atomically_and_keeps_the_usual_file_mode(tmp_path):
  path = tmp_path / "ckpt.pt"
  param, opt = _fresh()
  _train(param, opt, range(2))
  save_torch_checkpoint(opt.state_dict(), path)
  first = load_torch_checkpoint(path)
  _train(param, opt, range(2, 3))
  save_torch_checkpoint(opt.state_dict(), path)
  assert load_torch_checkpoint(path)["state"][0]["step"] == 3
  assert first["state"][0]["step"] == 2
  assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path):
  path = tmp_path / "ckpt.pt"
  param, opt = _fresh()
  _train(param, opt, range(2))
  save_torch_checkpoint(opt.state_dict(), path)
  before = path.read_bytes()
  with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for an unsavable object
    save_torch_checkpoint({"state": {0: {"bad": lambda: None}}, "param_groups": []}, path)
  assert path.read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_save_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
  target, link = tmp_path / "real.pt", tmp_path / "latest.pt"
  param, opt = _fresh()
  _train(param, opt, range(1))
  save_torch_checkpoint(opt.state_dict(), target)
  link.symlink_to(target)
  _train(param, opt, range(1, 2))
  save_torch_checkpoint(opt.state_dict(), link)
  assert link.is_symlink()
  assert load_torch_checkpoint(target)["state"][0]["step"] == 2


def test_save_to_a_file_object_as_torch_save(tmp_path):
  param, opt = _fresh()
  _train(param, opt, range(1))
  buffer = io.BytesIO()
  save_torch_checkpoint(opt.state_dict(), buffer)
  buffer.seek(0)
  assert torch.load(buffer, weights_only=True)["state"][0]["step"] == 1
