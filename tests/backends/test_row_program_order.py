"""The row program's op order (`row_program_ops._reads_first`): outputs computed in place.

An output whose destination (the gradient's sums, a slot's row) no op reads after
the output's first write is computed straight into its table by the kernel
(`row_program.cc`); otherwise it is computed aside and copied at the end of each
chunk. The compiler moves the ops that read an overwritten row as early as their
operands allow, so FTRL's `accumulator` (read by `sqrt(n)` after `n + g * g` in
the rule's own order) and SGD's and Adagrad's slots need no copy. The bits are
checked by tests/backends/test_row_program.py (the same ops, reordered).
"""

import jax.numpy as jnp
import pytest

from optax_sparse_adam._backends.cpu import row_program, row_program_ops
from optax_sparse_adam._core.row_rules import adagrad, ftrl


def _outputs_not_in_place(rule, hyper) -> list[int]:
  """The destinations (input registers) of the outputs the kernel would copy."""
  key = row_program._hyper_key(hyper)
  assert not isinstance(key, str)
  traced = row_program._program(rule, False, (8, 6), key[0], key[1], jnp.dtype(jnp.int32), True)
  assert traced.program is not None, traced.refusal
  code = traced.program.code
  num_prologue, num_row_ops, out_reg, num_slots = code[1], code[2], code[3], code[4]
  slot_regs = code[5 : 5 + num_slots]
  ops = code[5 + num_slots :]
  row_ops = [ops[i : i + 5] for i in range(0, len(ops), 5)][num_prologue:]
  assert len(row_ops) == num_row_ops
  copied = []
  for src, dst in [(out_reg, 0), *((r, 2 + k) for k, r in enumerate(slot_regs))]:
    first_write = next(i for i, op in enumerate(row_ops) if op[1] == src)
    last_read = max(
      (i for i, op in enumerate(row_ops) if dst in row_program_ops._reads(list(op))), default=-1
    )
    if last_read > first_write:
      copied.append(dst)
  return copied


@pytest.mark.parametrize(
  "rule, hyper",
  [
    (ftrl.FtrlRule(), ftrl.FtrlHyperparams(0.2)),
    (
      ftrl.FtrlRule(),
      ftrl.FtrlHyperparams(
        0.2,
        l1_regularization_strength=0.05,
        l2_regularization_strength=0.01,
        l2_shrinkage_regularization_strength=0.02,
        beta=0.1,
      ),
    ),
    (adagrad.AdagradRule(), adagrad.AdagradHyperparams(0.1)),
  ],
  ids=["ftrl", "ftrl_all_options", "adagrad"],
)
def test_outputs_are_computed_in_place(rule, hyper):
  assert _outputs_not_in_place(rule, hyper) == []


def test_rule_order_kept_without_the_pass(monkeypatch):
  # The check above can fail: without the pass FTRL's accumulator is copied.
  row_program._program.cache_clear()
  monkeypatch.setattr(row_program_ops, "_reads_first", lambda c, num_inputs: None)
  try:
    assert _outputs_not_in_place(ftrl.FtrlRule(), ftrl.FtrlHyperparams(0.2)) == [2]
  finally:
    row_program._program.cache_clear()
