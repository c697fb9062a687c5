"""Strict test setup: warnings are errors (pyproject), JAX on CPU, reproducible hypothesis."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
  "ci",
  max_examples=200,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
