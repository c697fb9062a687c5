"""The CPU kernels' sources compile without warnings of their own under `-Wall`.

Each `.cc` file includes `ffi_common.h` and gets its own copy of it (an anonymous
namespace): a helper there that one file does not call must be `inline` (or a
template), or that file warns `-Wunused-function`. jaxlib's headers warn too;
those lines are not the package's and are left out. The files compile at -O0
(the front end's warnings, unused functions among them, do not depend on it):
about a minute for the five, so the slow tier.
"""

import os
import pathlib
import re
import shutil
import subprocess

import jax.ffi
import pytest

CPU_DIR = pathlib.Path(__file__).resolve().parents[2] / "optax_sparse_adam" / "_backends" / "cpu"
SOURCES = sorted(path.name for path in CPU_DIR.glob("*.cc"))
# A warning located in one of the package's kernel files: `<path>/<file>:<line>:<col>: warning:`.
OWN_WARNING = re.compile(r"_backends/cpu/[\w.]+:\d+:\d+: warning:")
COMPILER = shutil.which(os.environ.get("CXX", "g++"))


def test_the_kernel_sources_are_found():
  assert "kernels.cc" in SOURCES and (CPU_DIR / "ffi_common.h").exists(), SOURCES


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_source_compiles_without_warnings_of_its_own(source, tmp_path):
  if COMPILER is None:
    assert os.environ.get("OPTAX_SPARSE_ADAM_REQUIRE_CPU_KERNELS") != "1", "no C++ compiler"
    pytest.skip("no C++ compiler (the kernels are optional)")
  # setup.py's flags (but -O0, to be quick) and its include directory.
  command = [COMPILER, "-std=c++17", "-O0", "-Wall", "-ffp-contract=off", "-fno-math-errno"]
  command += ["-I", jax.ffi.include_dir(), "-c", str(CPU_DIR / source)]
  command += ["-o", str(tmp_path / "out.o")]
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  own = [line for line in done.stderr.splitlines() if OWN_WARNING.search(line)]
  assert not own, "\n".join(own)
