"""Lazy, catch-up and dense Adam on example recipes: distance to dense Adam, metric over training.

Each recipe (benchmarks/_catch_up_recipes.py: a matrix-factorisation
recommender, examples/dlrm_side_by_side.py's DLRM in float32, and
examples/node2vec.py's skip-gram on a networkx graph) is trained with the same
batches and initial weights by:

- lazy Adam: `sparse_adam` (torch.optim.SparseAdam's numerics);
- catch-up: `sparse_adam(catch_up_idle_rows=True)`, the batch's rows brought
  up to date before the forward pass (`catch_up_rows`), `catch_up_all_rows`
  before each measurement;
- catch-up at the step only (`--step-only`): the same without `catch_up_rows`
  (the gradient is taken at a row's value before its idle steps);
- dense Adam: `optax.adam` on the densified gradient (zeros where the batch has
  none), with this package's eps placement (`eps` added to `sqrt(v)`, as torch's
  SparseAdam does: `optax.adam`'s eps, injected as `eps / sqrt(1 - b2^t)`).

The tables only differ between the runs; other parameters (DLRM's MLPs) step
with `optax.adam` in every run. Every `--every` steps it records the relative
distance of the tables to dense Adam's, `||T - T_dense|| / ||T_dense||` over
all tables, and the recipe's metric (held-out MSE; DLRM: the progressive log
loss, each batch's loss before it trains, mean of the window; Node2Vec: the
skip-gram loss on a fixed sample of pairs). It prints the curves (mean and
min..max over seeds), the final metric of each optimizer over the seeds, and
with `--plot` draws them. The recommender runs twice: as it is, and with its
item table fixed to the hidden one (`mf_convex`: only the user table trains, a
convex problem whose dense trajectory is stable, so distances show the
catch-up's own error rather than the drift of two nonconvex runs).

Run from the repository root:

  python -m benchmarks.catch_up_quality                    # 4 recipes, 3 seeds, ~1 min
  python -m benchmarks.catch_up_quality --plot             # and docs/catch_up_curves.png
  python -m benchmarks.catch_up_quality --recipes mf mf_convex --step-only
  python -m benchmarks.catch_up_quality --recipes mf node2vec --bf16-tables

With `--bf16-tables` it also trains lazy Adam (float32 moments) on bfloat16
tables read in float32: rounded to nearest (the default) and stochastically
(`param_rounding="stochastic"`).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks import _catch_up_recipes as recipes
from benchmarks import _curves


def dense_adam(learning_rate: float, b1=0.9, b2=0.999, eps=1e-8) -> optax.GradientTransformation:
  """`optax.adam` with eps added to `sqrt(v)` before the bias correction, as `sparse_adam` does.

  `sparse_adam` steps `-lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)`, which is
  `optax.adam`'s `-lr m_hat / (sqrt(v_hat) + eps_t)` with `eps_t = eps / sqrt(1 - b2^t)`.
  """

  def eps_t(count):  # count: the steps taken before this one
    return eps / jnp.sqrt(1 - b2 ** (count + 1))

  return optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps_t)


def check_dense_adam() -> float:
  """The largest difference of `dense_adam` from `sparse_adam` given every row, over 50 steps."""
  rng = np.random.default_rng(0)
  params = {"t": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)}
  ours, dense = osa.sparse_adam(0.05), dense_adam(0.05)
  p_ours, p_dense = params, params
  s_ours, s_dense = ours.init(params), dense.init(params)
  all_rows = jnp.arange(6)[:, None]
  for _ in range(50):
    g = jnp.asarray(rng.normal(size=(6, 3)) * (rng.random((6, 1)) < 0.5), jnp.float32)
    u, s_ours = ours.update({"t": sparse.BCOO((g, all_rows), shape=(6, 3))}, s_ours, p_ours)
    p_ours = osa.apply_updates(p_ours, u)
    u, s_dense = dense.update({"t": g}, s_dense, p_dense)
    p_dense = optax.apply_updates(p_dense, u)
  return float(jnp.max(jnp.abs(p_ours["t"] - p_dense["t"])))


# With --bf16-tables: lazy Adam (float32 moments) on bfloat16 tables, read in float32,
# rounded to nearest or stochastically (`param_rounding`).
BF16_KINDS = {"lazy, bf16 table": "nearest", "lazy, bf16 table, stochastic": "stochastic"}


def as_float32(tables: dict) -> dict:
  return {name: t.astype(jnp.float32) for name, t in tables.items()}


def make_step(recipe: recipes.Recipe, kind: str, opt, other_opt):
  """One jitted training step of `recipe`'s tables under `kind`, its other parameters by adam."""
  shapes = {name: t.shape for name, t in recipe.tables.items()}

  def step(tables, other, state, other_state, constants, batch):
    if kind == "catch-up":
      tables, state = osa.catch_up_rows(opt, tables, state, recipe.batch_ids(batch))
    read = as_float32(tables) if kind in BF16_KINDS else tables
    loss, row_grads, other_grads = recipe.loss_and_row_grads(read, other, constants, batch)
    if kind == "dense":
      grads = {n: jnp.zeros(shapes[n]).at[i].add(g) for n, (i, g) in row_grads.items()}
      updates, state = opt.update(grads, state, tables)
      tables = optax.apply_updates(tables, updates)
    else:
      grads = {n: sparse.BCOO((g, i[:, None]), shape=shapes[n]) for n, (i, g) in row_grads.items()}
      updates, state = opt.update(grads, state, tables)
      tables = osa.apply_updates(tables, updates)
    if other is not None:
      updates, other_state = other_opt.update(other_grads, other_state, other)
      other = optax.apply_updates(other, updates)
    return tables, other, state, other_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2, 3))


def train(recipe: recipes.Recipe, kind: str, step, opt, other_opt, every: int):
  """Snapshots of the tables and the metric every `every` steps; the final scores."""
  tables, other = jax.tree.map(jnp.copy, (recipe.tables, recipe.other))
  if kind in BF16_KINDS:
    tables = {name: t.astype(jnp.bfloat16) for name, t in tables.items()}
  state = opt.init(tables)
  other_state = other_opt.init(other) if other is not None else None
  metric = jax.jit(recipe.metric) if recipe.metric else None
  snapshots, metrics, losses = [], [], []
  for t, batch in enumerate(recipe.batches, 1):
    tables, other, state, other_state, loss = step(
      tables, other, state, other_state, recipe.constants, batch
    )
    losses.append(float(loss))
    if t % every == 0:
      seen = tables
      if kind.startswith("catch-up"):
        seen = osa.catch_up_all_rows(opt, tables, state)[0]
      seen = as_float32(seen)
      snapshots.append(jax.tree.map(np.asarray, seen))
      metrics.append(float(metric(seen, other)) if metric else float(np.mean(losses[-every:])))
  scores = recipe.final_scores(snapshots[-1], other) if recipe.final_scores else {}
  return snapshots, metrics, scores


def distance(a: dict, b: dict) -> float:
  num = sum(np.sum((a[k] - b[k]) ** 2) for k in a)
  return float(np.sqrt(num / sum(np.sum(b[k] ** 2) for k in b)))


METRICS = {
  "mf": "held-out MSE",
  "mf_convex": "held-out MSE",
  "dlrm": "progressive log loss (window mean)",
  "node2vec": "skip-gram loss, fixed sample",
}
TITLES = {
  "mf": "matrix factorisation",
  "mf_convex": "matrix factorisation, item table fixed",
  "dlrm": "DLRM (dlrm_side_by_side.py, float32)",
  "node2vec": "Node2Vec (node2vec.py)",
}


def run_recipe(name: str, args) -> dict:
  kinds = ["lazy", "catch-up", "dense"]
  if args.step_only:
    kinds.insert(1, "catch-up at the step only")
  if args.bf16_tables:
    kinds[1:1] = list(BF16_KINDS)
  steps_of = {
    "mf": args.mf_steps,
    "mf_convex": args.mf_steps,
    "dlrm": args.dlrm_steps,
    "node2vec": args.node2vec_steps,
  }
  every = max(1, steps_of[name] // args.points)
  builders = {
    "mf": lambda s: recipes.matrix_factorisation(s, steps=args.mf_steps),
    "mf_convex": lambda s: recipes.matrix_factorisation(s, steps=args.mf_steps, convex=True),
    "dlrm": lambda s: recipes.dlrm(s, steps=args.dlrm_steps),
    "node2vec": lambda s: recipes.node2vec(s, graph=args.graph, steps=args.node2vec_steps),
  }
  out = {kind: {"distance": [], "metric": [], "scores": []} for kind in kinds}
  steppers = {}
  for seed in range(args.seeds):
    recipe = builders[name](seed)
    for kind in ["dense"] + [k for k in kinds if k != "dense"]:  # dense first: the reference
      if kind not in steppers:  # one step function per kind: the seeds reuse its compilation
        if kind in BF16_KINDS:
          opt = osa.sparse_adam(
            recipe.lr, mu_dtype=jnp.float32, nu_dtype=jnp.float32,
            param_rounding=BF16_KINDS[kind],
          )  # fmt: skip
        else:
          opt = dense_adam(recipe.lr) if kind == "dense" else osa.sparse_adam(
            recipe.lr, catch_up_idle_rows=kind.startswith("catch-up")
          )  # fmt: skip
        other_opt = optax.adam(recipe.lr)
        steppers[kind] = (make_step(recipe, kind, opt, other_opt), opt, other_opt)
      snapshots, metrics, scores = train(recipe, kind, *steppers[kind], every)
      if kind == "dense":
        reference = snapshots
      out[kind]["distance"].append(
        [distance(a, b) for a, b in zip(snapshots, reference, strict=True)]
      )
      out[kind]["metric"].append(metrics)
      out[kind]["scores"].append(scores)
  out["steps"] = list(range(every, every * len(reference) + 1, every))
  return out


def print_finals(name: str, out: dict, kinds: list) -> None:
  scores = list(out[kinds[0]]["scores"][0])
  header = ["final " + METRICS[name] + " (lower is better)", *scores, "final distance to dense"]
  print(f"\n{TITLES[name]}: mean ± std over seeds (min..max)\n")
  print("| optimizer | " + " | ".join(header) + " |")
  print("|---|" + "---:|" * len(header))
  for kind in kinds:
    r = out[kind]
    columns = [[m[-1] for m in r["metric"]]]
    columns += [[s[score] for s in r["scores"]] for score in scores]
    columns += [[d[-1] for d in r["distance"]]]
    cells = [
      f"{np.mean(c):.4f} ± {np.std(c):.4f} ({np.min(c):.4f}..{np.max(c):.4f})" for c in columns
    ]
    print(f"| {kind} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--recipes", nargs="+", choices=list(TITLES), default=list(TITLES))
  parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. n-1")
  parser.add_argument("--mf-steps", type=int, default=1000)
  parser.add_argument("--dlrm-steps", type=int, default=300)
  parser.add_argument("--node2vec-steps", type=int, default=2000)
  parser.add_argument("--graph", default="les_miserables", help="node2vec's graph")
  parser.add_argument("--points", type=int, default=20, help="measurements per run")
  parser.add_argument("--step-only", action="store_true", help="also catch-up at the step only")
  parser.add_argument(
    "--bf16-tables",
    action="store_true",
    help="also lazy Adam on bfloat16 tables, rounded to nearest and stochastically",
  )
  parser.add_argument(
    "--plot",
    nargs="?",
    type=_curves.Path,
    const=_curves.ROOT / "docs" / "catch_up_curves.png",
    help="draw the curves to this PNG (default docs/catch_up_curves.png)",
  )
  args = parser.parse_args(argv)
  gap = check_dense_adam()
  assert gap < 1e-5, f"dense_adam is not sparse_adam's math on full gradients: {gap}"
  start = time.perf_counter()
  results = {name: run_recipe(name, args) for name in args.recipes}
  print(
    f"# lazy vs catch-up vs dense Adam: seeds 0..{args.seeds - 1}; "
    f"{time.perf_counter() - start:.0f} s; {jax.default_backend()}; dense_adam matches "
    f"sparse_adam on full gradients to {gap:.1e}"
  )
  panels = []
  for name, out in results.items():
    kinds = [k for k in out if k != "steps"]
    distances = {k: out[k]["distance"] for k in kinds if k != "dense"}
    metrics = {k: out[k]["metric"] for k in kinds}
    title = TITLES[name]
    _curves.print_curves(f"{title}, relative distance to dense Adam", out["steps"], distances)
    _curves.print_curves(f"{title}, {METRICS[name]}", out["steps"], metrics)
    print_finals(name, out, kinds)
    panels.append(
      {
        "steps": out["steps"],
        "curves": distances,
        "title": f"{title}: distance to dense Adam",
        "ylabel": "||T - T_dense|| / ||T_dense||",
        "log": True,
      }
    )
    panels.append(
      {"steps": out["steps"], "curves": metrics, "title": title, "ylabel": METRICS[name]}
    )
  if args.plot:
    _curves.plot_panels(
      args.plot,
      panels,
      columns=2,
      title=f"lazy, catch-up and dense Adam: mean and min..max over seeds 0..{args.seeds - 1}",
    )


if __name__ == "__main__":
  main()
