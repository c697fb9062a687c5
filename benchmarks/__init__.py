"""Benchmarks of optax_sparse_adam; run them from the repository root (README: Performance)."""
