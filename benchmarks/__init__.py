"""Benchmarks of optax_sparse_adam; run them from the repository root (see the README, Performance)."""
