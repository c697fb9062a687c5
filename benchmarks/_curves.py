"""Curves over training for the quality benchmarks: mean and min..max over seeds, printed, drawn.

Imports nothing heavy: matplotlib is imported when a figure is drawn (the
`examples` extra has it).
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def windowed(values: Sequence[float], window: int) -> np.ndarray:
  """The mean of each consecutive `window` values (the last partial window dropped)."""
  values = np.asarray(values, np.float64)
  usable = len(values) // window * window
  return values[:usable].reshape(-1, window).mean(axis=1)


def print_curves(title: str, steps: Sequence[int], curves: dict[str, list], rows: int = 6):
  """Prints mean (min..max over seeds) of each curve at about `rows` of `steps`."""
  picked = sorted({int(round(k)) for k in np.linspace(0, len(steps) - 1, rows)})
  print(f"\n{title}: mean (min..max) over seeds\n")
  print("| step | " + " | ".join(curves) + " |")
  print("|---:|" + "---:|" * len(curves))
  for k in picked:
    cells = []
    for runs in curves.values():
      at = np.array([run[k] for run in runs])
      cells.append(f"{at.mean():.4g} ({at.min():.4g}..{at.max():.4g})")
    print(f"| {steps[k]} | " + " | ".join(cells) + " |")


def plot_panels(path: Path, panels: list[dict], *, columns: int, title: str) -> None:
  """Draws each panel's curves (mean line, min..max band over seeds) and writes a PNG.

  A panel is a dict: `steps`, `curves` ({name: [one sequence per seed]}), `title`,
  `ylabel`, and optionally `log` (log y axis) and `styles` ({name: plot kwargs}).
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = -(-len(panels) // columns)
  fig, axes = plt.subplots(
    rows, columns, figsize=(4.6 * columns, 3.4 * rows), constrained_layout=True, squeeze=False
  )
  for ax, panel in zip(axes.ravel(), panels, strict=False):
    steps = np.asarray(panel["steps"])
    for k, (name, runs) in enumerate(panel["curves"].items()):
      runs = np.asarray(runs, np.float64)
      style = {"color": f"C{k}", **panel.get("styles", {}).get(name, {})}
      ax.plot(steps, runs.mean(0), label=name, lw=1.4, **style)
      ax.fill_between(steps, runs.min(0), runs.max(0), color=style["color"], alpha=0.2, lw=0)
    if panel.get("log"):
      ax.set_yscale("log")
    ax.set_title(panel["title"], fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(panel["ylabel"], fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  for ax in axes.ravel()[len(panels) :]:
    ax.set_visible(False)
  fig.suptitle(title, fontsize=9)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=80)
  plt.close(fig)
  print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
