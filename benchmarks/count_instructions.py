"""Instructions per sparse_adam step, counted by callgrind: deterministic on a loaded machine.

Wall-clock timings on a shared machine drift with the load; instruction counts
do not. Each measurement runs a process under `valgrind --tool=callgrind` that
builds fixed inputs (V x D float32 table, B ids a step, Zipf or uniform),
compiles the jitted, donated `update` + `apply_updates` step once and runs it;
it is run twice, with `--steps` and with 0 extra steps, and the difference,
divided by `--steps`, is the cost of one step (compilation and start-up cancel
out). Counted: the instructions executed by the fused CPU kernels' library
(`_kernels*.so`: the masked step and the scatter-add), on every thread, with
what it calls (memset, malloc). XLA's own ops around them are not counted
(`benchmarks.compiled_diff` compares those programs).

Settings are sparse_adam options (`--setting NAME=JSON`, repeatable; a
"_kernels": false entry runs the XLA ops, "_factory": "sparse_adamw" makes the
optimizer with `sparse_adamw`). With `--b`, a second checkout is
counted the same way and the ratio B/A printed (A: `--a`, default `.`).

Run from the repository root (about 3 minutes a setting and checkout):

  python -m benchmarks.count_instructions
  python -m benchmarks.count_instructions --a ../before --b . --dist uniform
  python -m benchmarks.count_instructions --setting 'bf16={"mu_dtype": "bfloat16"}'
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_DRIVE = """
import json, os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp
from jax.experimental import sparse
import optax_sparse_adam as osa
from benchmarks import _common as c

dist, vocab, dim, batch, steps = sys.argv[1], *(int(x) for x in sys.argv[2:6])
options = json.loads(sys.argv[6])
kernels = options.pop("_kernels", True)
factory = getattr(osa, options.pop("_factory", "sparse_adam"))
ids, values = c.id_batches(dist, vocab, batch), c.grad_values(batch, dim)
opt = factory(1e-3, **options)
params = {"table": jnp.zeros((vocab, dim), jnp.float32)}
state = opt.init(params)
grads = [
  {"table": sparse.BCOO((jnp.asarray(v), jnp.asarray(i[:, None])), shape=(vocab, dim))}
  for i, v in zip(ids, values)
]
with osa.use_cpu_kernels(kernels):
  step = jax.jit(c.sparse_step(opt), donate_argnums=(0, 1))
  for k in range(2 + steps):  # two warm-up steps (compilation, first-call costs) in every run
    params, state = step(params, state, grads[k % len(grads)])
  jax.block_until_ready((params, state))
"""

DEFAULT_SETTINGS = {"full": {}}


def _is_kernels(obj: str) -> bool:
  return "/_kernels" in obj


def _parse(path: str) -> int:
  """Instructions of the `_kernels` library in a callgrind profile, with what it calls.

  The self cost of every function of the library, plus the inclusive cost of
  its calls into other libraries (memset, malloc), on every thread.
  """
  names: dict[str, str] = {}
  kernels = 0
  caller_ob = callee_ob = ""
  call_pending = False

  def name(text: str) -> str:
    match = re.match(r"\((\d+)\)(?: (.*))?", text)
    if not match:
      return text
    key, value = match.groups()
    if value is not None:
      names[key] = value
    return names.get(key, "")

  with open(path) as f:
    for line in f:
      key, sep, text = line.rstrip("\n").partition("=")
      if sep and key in ("ob", "cob", "fn"):
        if key == "ob":
          caller_ob = callee_ob = name(text)
        elif key == "cob":
          callee_ob = name(text)
        else:
          callee_ob = caller_ob
        continue
      if key == "calls" and sep:
        call_pending = True
        continue
      parts = line.split()
      if len(parts) < 2 or not (parts[0][:1].isdigit() or parts[0][:1] in "+-*"):
        continue
      cost = int(parts[1])
      if call_pending:  # a call's line: `cost` is the call's inclusive cost
        call_pending = False
        if _is_kernels(caller_ob) and not _is_kernels(callee_ob):
          kernels += cost
        callee_ob = caller_ob
      elif _is_kernels(caller_ob):
        kernels += cost
  return kernels


def _count(tree: str, dist: str, size: tuple[int, int, int], steps: int, options: dict) -> float:
  env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_PLATFORMS="cpu")
  counts = []
  with tempfile.TemporaryDirectory() as tmp:
    for n in (0, steps):
      out = os.path.join(tmp, f"callgrind.{n}")
      subprocess.run(
        [
          "valgrind",
          "--tool=callgrind",
          f"--callgrind-out-file={out}",
          sys.executable,
          "-c",
          _DRIVE,
          dist,
          *(str(x) for x in size),
          str(n),
          json.dumps(options),
        ],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
      )
      counts.append(_parse(out))
  return (counts[1] - counts[0]) / steps


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--a", default=".", help="a checkout (a directory)")
  parser.add_argument("--b", default=None, help="a second checkout, compared with --a")
  parser.add_argument("--dist", choices=("zipf", "uniform"), default="zipf")
  parser.add_argument("--vocab", type=int, default=1_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=8, help="steps counted (after 2 warm-up)")
  parser.add_argument(
    "--setting", action="append", default=[], metavar="NAME=JSON", help="sparse_adam options"
  )
  args = parser.parse_args(argv)
  if shutil.which("valgrind") is None:
    sys.exit("valgrind not found: install it (apt-get install valgrind)")
  settings = dict(DEFAULT_SETTINGS)
  if args.setting:
    settings = {}
    for item in args.setting:
      name, _, options = item.partition("=")
      settings[name] = json.loads(options or "{}")

  size = (args.vocab, args.dim, args.batch)
  trees = {"A": args.a} if args.b is None else {"A": args.a, "B": args.b}
  print(f"# kernel instructions per step (callgrind): V={args.vocab:,} D={args.dim}")
  print(f"# B={args.batch:,} {args.dist} ids, {args.steps} steps counted; trees: {trees}")
  results: dict[str, dict[str, float]] = collections.defaultdict(dict)
  for setting, options in settings.items():
    for side, tree in trees.items():
      count = _count(tree, args.dist, size, args.steps, dict(options))
      results[setting][side] = count
      print(f"{setting:<24} {side}: {count:>14,.0f}", flush=True)
    if args.b is not None:
      a, b = results[setting]["A"], results[setting]["B"]
      print(f"{setting:<24} B/A: {b / a:.4f}" if a else f"{setting:<24} B/A: -", flush=True)
  if len(results) > 1:
    first = next(iter(results.values()))
    print("\nratio to the first setting, per tree:")
    for setting, by_side in results.items():
      for side, count in by_side.items():
        base = first[side]
        print(f"{setting:<24} {side}: {count / base:.3f}x" if base else f"{setting:<24} -")


if __name__ == "__main__":
  main()
