"""The one signature every backend's masked step has."""

from typing import Protocol

from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan


class StepBackend(Protocol):
  """One parameter's masked step: coalesce, run `plan.rule` on the touched rows, scatter.

  Implementations: `xla.masked_step` (every backend, rule and option),
  `accelerator.masked_step` (the same, coalescing by one sort) and
  `cpu.kernels.masked_step` (the fused kernels of the rules that have one).
  All return the same results; on the CPU, bit for bit.
  """

  def __call__(self, inputs: StepInputs, plan: StepPlan) -> RowsStep: ...
