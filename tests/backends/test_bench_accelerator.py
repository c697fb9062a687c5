"""The accelerator benchmark runs end to end at toy sizes on whatever backend JAX has.

A smoke test: every row is produced and every ratio printed; no timing is asserted.
"""

import pytest

from benchmarks import bench_accelerator


# torch 2.11 warns when a sparse tensor is built without invariant checks; the
# benchmark builds its gradients with check_invariants=False on purpose.
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning")
@pytest.mark.slow  # a benchmark's smoke run; the step it times is tested in test_accelerator
def test_small_run_prints_every_row(capsys):
  bench_accelerator.main(
    ["--small", "--vocab", "1000", "3000", "--batch", "64", "--steps", "1", "--repeats", "1"]
  )
  out = capsys.readouterr().out
  assert "plain/ours" in out and "torch/ours" in out and "dense/ours" in out
  table = [line for line in out.splitlines() if line.count(" | ") == 2]
  assert len(table) == 1 + 4  # the header; two sizes x two id streams, one batch size
  assert "flat in V" in out
  assert "effective bandwidth" in out
  assert "dense/sparse" in out or "flax is not installed" in out


@pytest.mark.slow
def test_table_batched_benchmark_small_run_prints_every_path(capsys):
  """`bench_tables --batched --small` (issue 42): each path's row and the ratio."""
  from benchmarks import bench_tables

  bench_tables.main(["--batched", "--small", "--steps", "2", "--repeats", "1"])
  out = capsys.readouterr().out
  assert "| tables batched (one sort) |" in out and "| each table alone |" in out
  assert "each table alone / tables batched:" in out
