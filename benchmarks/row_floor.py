"""The rows' share of each option's step: the kernels' row loops alone, compiled and timed.

Builds `benchmarks/row_floor.cc` (the kernels' own `AdamRow`, `AddRow`, catch-up
factors and prefetch, included from kernels.cc, with the flags setup.py gives
them) and runs it once per option (weight decay, amsgrad, per-row steps, all
three, catch-up, AdamW + catch-up, bf16 moments with stochastic rounding): the
step kernel's row loop and the scatter-add over B distinct random rows of V-row
tables, on one thread, the option and the default interleaved round by round,
each on tables of its own. The ratios are what the rows alone cost against the
default's: a whole step, which adds fixed costs (dispatch, the sort, XLA ops),
has smaller ratios, never below what its rows need more than the default's
(docs/performance, "Where the options' extra time went"). With a small `--vocab`
(8192: the tables stay in cache) they are the options' arithmetic alone. Needs a
C++17 compiler (`CXX`, default g++).

Run from the repository root (a minute; up to V x D x 4 bytes x 7 tables of memory):

  python -m benchmarks.row_floor
  python -m benchmarks.row_floor --vocab 4000000 --rounds 100
"""

import itertools
import os
import subprocess
import tempfile
from pathlib import Path

import jax.ffi

from benchmarks import _common as c

_SOURCE = Path(__file__).with_name("row_floor.cc")


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)
  parser.add_argument("--rounds", type=int, default=200, help="interleaved rounds")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    binary = Path(tmp) / "row_floor"
    compiler = os.environ.get("CXX", "g++")
    flags = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-w"]
    include = ["-I", jax.ffi.include_dir()]
    subprocess.run([compiler, *flags, *include, str(_SOURCE), "-o", str(binary)], check=True)
    sizes = [args.vocab, args.dim, args.batch, args.rounds]
    print(f"V={args.vocab:,}, D={args.dim}, B={args.batch:,} random rows, {args.rounds} rounds")
    for which in itertools.count(1):  # one process per option: its tables and the default's
      code = subprocess.run([str(binary), *map(str, sizes), str(which)]).returncode
      if code == 3:  # no option `which`: all done
        break
      if code:
        raise subprocess.CalledProcessError(code, [str(binary), *map(str, sizes), str(which)])


if __name__ == "__main__":
  main()
