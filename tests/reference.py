"""An independent NumPy reference of torch.optim.SparseAdam; it does not call the library.

Dense bookkeeping on purpose: the touched set is a boolean mask built with np.add.at,
so nothing here shares code or structure with the row-sorting implementation under test.
"""

import math

import numpy as np


class NumpySparseAdam:
  """torch.optim.SparseAdam for one parameter, in `dtype` arithmetic (float64 by default)."""

  def __init__(self, param, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, dtype=None):
    self.dtype = np.dtype(dtype or np.float64)
    self.param = np.array(param, dtype=self.dtype)
    self.exp_avg = np.zeros_like(self.param)
    self.exp_avg_sq = np.zeros_like(self.param)
    self.step_count = 0
    self.lr, self.betas, self.eps, self.maximize = lr, betas, eps, maximize

  def step(self, indices, values, lr=None):
    """One step; indices (nse, n_sparse), out-of-range ones are padding; values (nse, *dense)."""
    lr = self.lr if lr is None else lr
    b1, b2 = self.betas
    self.step_count += 1
    if len(values) == 0:  # an empty gradient still counts a step, as in torch
      return
    values = np.asarray(values, dtype=self.dtype)
    indices = np.asarray(indices)
    n_sparse = indices.shape[1]
    sparse_shape = self.param.shape[:n_sparse]
    keep = np.all((indices >= 0) & (indices < np.array(sparse_shape)), axis=1)
    indices, values = indices[keep], values[keep]
    if self.maximize:
      values = -values
    grad = np.zeros_like(self.param)
    touched = np.zeros(sparse_shape, dtype=bool)
    np.add.at(grad, tuple(indices.T), values)
    touched[tuple(indices.T)] = True
    if not touched.any():
      return
    t = self.dtype.type
    g = grad[touched]
    m_old, v_old = self.exp_avg[touched], self.exp_avg_sq[touched]
    m_upd = (g - m_old) * t(1 - b1)
    v_upd = (g * g - v_old) * t(1 - b2)
    m_new = m_old + m_upd
    v_new = v_old + v_upd
    denom = np.sqrt(v_new) + t(self.eps)
    step_size = lr * math.sqrt(1 - b2**self.step_count) / (1 - b1**self.step_count)
    self.exp_avg[touched] = m_new
    self.exp_avg_sq[touched] = v_new
    self.param[touched] = self.param[touched] + (-t(step_size)) * (m_new / denom)
