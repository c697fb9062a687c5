"""examples/node2vec.py: its walks keep to the training graph, and a short run learns the graph.

The short runs are subprocesses, as a user runs the script (lazy Adam, then catch-up).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("networkx")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "node2vec.py"
SHORT = ["--steps", "300", "--walks-per-node", "5", "--json"]


def _load_example():
  sys.path.insert(0, str(SCRIPT.parent))  # the script imports _gallery from its folder
  try:
    spec = importlib.util.spec_from_file_location("node2vec_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(SCRIPT.parent))
  return module


def test_walks_and_pairs_keep_to_the_training_edges():
  n2v = _load_example()
  rng = np.random.default_rng(0)
  data = n2v.load_graph("karate", rng)
  train = {frozenset(e) for e in data.train_edges.tolist()}
  held_out = {frozenset(e) for e in data.test_edges.tolist()}
  assert len(held_out) == 8 and not train & held_out
  assert len(train) + len(held_out) == 78  # the karate club's edges, split
  walks = n2v.random_walks(data, rng, walks_per_node=2, length=10, p=0.5, q=2.0)
  assert walks.shape == (68, 10)
  steps = {frozenset(s) for w in walks.tolist() for s in zip(w[:-1], w[1:], strict=True)}
  assert steps <= train  # every step of every walk is a training edge
  pairs = n2v.skipgram_pairs(walks, window=2)
  assert pairs.shape == (68 * (9 + 8) * 2, 2)
  assert {frozenset(p) for p in pairs.tolist() if p[0] != p[1]} >= steps


# The catch-up variant in the slow tier: the catch-up step is checked in tests/core.
@pytest.mark.parametrize(
  "catch_up", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["lazy", "catch-up"]
)
def test_a_short_run_learns_the_communities_and_the_held_out_links(catch_up):
  done = subprocess.run(
    [sys.executable, str(SCRIPT), *SHORT, *(["--catch-up"] if catch_up else [])],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  assert report["loss"][0] == pytest.approx(6 * np.log(2), rel=1e-3)  # zero contexts: 6 x log 2
  assert report["loss"][-1] < 0.6 * report["loss"][0]
  assert report["community_accuracy"] >= 0.85  # the two clubs: chance is 0.5
  assert report["link_auc"] > 0.7  # chance is 0.5
