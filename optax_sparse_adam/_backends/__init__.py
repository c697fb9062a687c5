"""How a step runs on each backend: one dispatcher (`dispatch`) over the ways to run it.

`xla` runs on every backend and supports every option; `cpu` holds the fused
CPU kernels. The core calls only `dispatch`.
"""
