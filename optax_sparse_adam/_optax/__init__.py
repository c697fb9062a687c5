"""The optax layer: transformations, the leaf step and the apply, over the backends (private).

Re-exported from `optax_sparse_adam`; calls the backends only through
`_backends.dispatch` (docs/architecture.md).
"""
