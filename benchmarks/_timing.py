"""Timing and formatting shared by every benchmark; imports nothing that picks a backend."""

import math
import time
from collections.abc import Callable
from typing import Any


def best_seconds(call: Callable[[], Any], repeats: int, *, warm_up: bool = True) -> float:
  """The fastest of `repeats` calls of `call`, which must block until its work is done.

  On a shared machine the fastest run is the one least disturbed by other
  processes. The first call (compilation included) is not timed unless
  `warm_up=False`, for a caller that warmed up otherwise.
  """
  if warm_up:
    call()
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    call()
    best = min(best, time.perf_counter() - start)
  return best


def ratio(a: float | None, b: float | None) -> str:
  return "—" if a is None or b is None else f"{a / b:.2f}x"
