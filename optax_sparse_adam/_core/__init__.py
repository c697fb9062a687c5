"""The core: Adam arithmetic, BCOO row plumbing, optax glue (private; see optax_sparse_adam)."""
