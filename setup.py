"""Builds the optional CPU kernels; everything else is declared in pyproject.toml.

The kernels are an XLA FFI library compiled against the headers that ship with
jaxlib (a build requirement). If they cannot be built (no C++ compiler, say),
the install still succeeds and sparse_adam runs its pure-XLA path on the CPU.
"""

import jax.ffi
from setuptools import Extension, setup

setup(
  ext_modules=[
    Extension(
      "optax_sparse_adam._backends.cpu._kernels",
      sources=[
        "optax_sparse_adam/_backends/cpu/kernels.cc",
        "optax_sparse_adam/_backends/cpu/rule_kernels.cc",
        "optax_sparse_adam/_backends/cpu/row_store.cc",
        "optax_sparse_adam/_backends/cpu/row_gather.cc",
        "optax_sparse_adam/_backends/cpu/row_round.cc",
        "optax_sparse_adam/_backends/cpu/row_program.cc",
      ],
      # Shared by the sources; listed so that the sdist carries it and edits rebuild.
      depends=[
        "optax_sparse_adam/_backends/cpu/ffi_common.h",
        "optax_sparse_adam/_backends/cpu/row_round.h",
      ],
      include_dirs=[jax.ffi.include_dir()],
      language="c++",
      # -ffp-contract=off: no FMA, every product rounded, as in XLA and torch.
      # -fno-math-errno: lets sqrt vectorize; IEEE results are unchanged.
      # -g0: Python's own CFLAGS ask for debug info, which made the library 36 MB (XLA's
      # FFI headers are templates); without it, 3.9 MB (2.5 MB of code).
      extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-g0"],
      optional=True,
    )
  ]
)
