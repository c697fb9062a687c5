"""How a step runs on each backend: one dispatcher (`dispatch`) over backends of one signature.

A backend is a `protocol.StepBackend`: `xla` runs on every backend and supports
every rule and option; `accelerator` coalesces by one sort; `cpu` holds the
fused CPU kernels of the rules that have one. The optax layer calls only `dispatch`.
"""
