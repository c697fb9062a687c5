"""The CPU backend: the fused XLA FFI kernels and huge-page advice. Private."""
