"""The bottom layer: row rules, coalescing, BCOO rows, errors, sharding helpers (private).

Nothing here imports `_backends`, `_optax` or a front end (docs/architecture.md).
"""
