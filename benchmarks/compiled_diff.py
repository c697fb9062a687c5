"""The compiled step programs of two checkouts, compared instruction by instruction.

For a change meant to leave the step as it was (a refactoring): if XLA compiles
the same instructions from both checkouts, the two steps do the same work, and
a timing difference between them can only be noise. Each checkout compiles
`sparse_adam.update` + `apply_updates` (jitted, donated; V x D float32, B ids)
for several options, with the CPU kernels and with XLA ops only, in a process
of its own; the optimized HLO is compared after dropping names, metadata and
source locations (renamed FFI targets and attributes are read as given by
`--renamed OLD NEW`).

Run from the repository root:

  python -m benchmarks.compiled_diff --a ../before --b .
  python -m benchmarks.compiled_diff --a ../before --b . \\
    --renamed optax_sparse_adam_adam_rows_f32 optax_sparse_adam_fused_adam_f32 \\
    --renamed "unique_rows = " "rows_unique = "
"""

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_DUMP = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import sparse
import optax_sparse_adam as osa

out, vocab, dim, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
CASES = {
  "plain": {},
  "amsgrad+weight_decay": dict(amsgrad=True, weight_decay=0.1),
  "per_row_bias_correction": dict(per_row_bias_correction=True),
  "maximize": dict(maximize=True),
}
for name, options in CASES.items():
  for kernels in (True, False):
    opt = osa.sparse_adam(1e-3, **options)

    def step(params, state, grads):
      updates, state = opt.update(grads, state, params)
      return osa.apply_updates(params, updates), state

    params = {"table": jnp.zeros((vocab, dim))}
    ids = np.random.default_rng(0).integers(0, vocab, (batch, 1)).astype(np.int32)
    grads = {"table": sparse.BCOO((jnp.ones((batch, dim)), jnp.asarray(ids)), shape=(vocab, dim))}
    with osa.use_cpu_kernels(kernels):
      lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt.init(params), grads)
    with open(f"{out}/{name}.{'kernels' if kernels else 'xla'}.hlo", "w") as f:
      f.write(lowered.compile().as_text())
"""


def _instructions(text: str, same_targets: list[tuple[str, str]]) -> list[str]:
  """The HLO's instructions, names and metadata dropped, sorted (order is the scheduler's)."""
  for a, b in same_targets:
    text = text.replace(b, a)
  lines = []
  for line in text.splitlines():
    line = line.strip()
    if " = " not in line or re.match(r"^\d+ ", line):  # skip the source-location tables
      continue
    line = re.sub(r", metadata=\{[^}]*\}", "", line)
    line = re.sub(r"%[\w.\-]+", "%_", line)
    line = re.sub(r"stack_frame_id=\d+", "", line)
    lines.append(line)
  return sorted(lines)


def _dump(tree: str, out: str, vocab: int, dim: int, batch: int) -> None:
  env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
  subprocess.run(
    [sys.executable, "-c", _DUMP, out, str(vocab), str(dim), str(batch)],
    cwd=tree,
    env=env,
    check=True,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--a", required=True, help="the checkout before (a directory)")
  parser.add_argument("--b", required=True, help="the checkout after (a directory)")
  parser.add_argument("--vocab", type=int, default=100_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument(
    "--renamed",
    action="append",
    nargs=2,
    default=[],
    metavar=("OLD", "NEW"),
    help="text renamed between the checkouts (an FFI target, an attribute): read NEW as OLD",
  )
  args = parser.parse_args(argv)
  same = [tuple(pair) for pair in args.renamed]

  with tempfile.TemporaryDirectory() as tmp:
    dirs = {side: Path(tmp, side) for side in ("a", "b")}
    for side, tree in (("a", args.a), ("b", args.b)):
      dirs[side].mkdir()
      _dump(tree, str(dirs[side]), args.vocab, args.dim, args.batch)
    differing = 0
    programs = sorted(dirs["a"].iterdir())
    for path in programs:
      a = _instructions(path.read_text(), same)
      b = _instructions((dirs["b"] / path.name).read_text(), same)
      diff = [
        line
        for line in difflib.unified_diff(a, b, lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
      ]
      differing += bool(diff)
      verdict = "same instructions" if not diff else f"{len(diff)} lines differ"
      print(f"{path.stem:<36} {len(a):>5} vs {len(b):>5} instructions: {verdict}")
      for line in diff[:6]:
        print(f"    {line[:160]}")
    print(f"\n{differing} of {len(programs)} compiled programs differ")
  return 0


if __name__ == "__main__":
  sys.exit(main())
