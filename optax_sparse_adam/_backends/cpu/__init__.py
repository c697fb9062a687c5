"""The CPU backend: fused XLA FFI kernels for the step and the apply, and huge pages."""
