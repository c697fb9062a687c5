"""What the lean optimizer states cost in quality, on two of the repository's example recipes.

Trains each recipe with each state setting for several seeds and prints the
final metric's mean and spread across seeds, next to full Adam's, and the
metric over training (`--plot` draws it: mean and min..max over seeds):

- matrix factorisation (examples/train_embedding.py's data and model: two
  tables, users 50k and items 20k, D=32): held-out RMSE after the training
  steps, and every 50 steps for the curve;
- DLRM (examples/dlrm_side_by_side.py's JAX half, float32: three
  `SparseEmbedBag` tables with sparse_adam, MLPs with optax.adam): the
  progressive validation log loss, the mean over the last 100 steps of each
  fresh batch's loss before it trains (the curve: its mean over each 20 steps).

Settings: full (the default), rowwise (`rowwise_second_moment=True`), bf16
(`mu_dtype=nu_dtype=bfloat16`, rounded to nearest), bf16_sr (the same,
`moment_rounding="stochastic"`), rowwise_bf16_sr (both), and for matrix
factorisation the tables themselves in bfloat16 (the moments too, the factory's
default): table_bf16 (rounded to nearest) and table_bf16_sr (`param_rounding="stochastic"`). A seed
sets the data, the initial weights and the batches.

  python -m benchmarks.lean_state_quality             # 3 seeds, about 3 minutes
  python -m benchmarks.lean_state_quality --plot      # and docs/lean_state_curves.png
  python -m benchmarks.lean_state_quality --seeds 1   # one seed
  python -m benchmarks.lean_state_quality --json      # the figures as JSON
  python -m benchmarks.lean_state_quality --recipes mf --settings table_bf16 table_bf16_sr \
      --mf-lr 0.001 --seeds 1                         # 16-bit tables against float32
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_sparse_adam as osa
from benchmarks import _curves

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

SETTINGS = {
  "full": {},
  "rowwise": {"rowwise_second_moment": True},
  "bf16": {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16},
  "bf16_sr": {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16, "moment_rounding": "stochastic"},
  "rowwise_bf16_sr": {
    "rowwise_second_moment": True,
    "mu_dtype": jnp.bfloat16,
    "nu_dtype": jnp.bfloat16,
    "moment_rounding": "stochastic",
  },
  # The table itself in bfloat16 (matrix factorisation only): rounded to nearest, or
  # stochastically (`param_rounding`); both with float32 moments.
  "table_bf16": {"table_dtype": jnp.bfloat16},
  "table_bf16_sr": {"table_dtype": jnp.bfloat16, "param_rounding": "stochastic"},
}
# The settings a recipe cannot run: the DLRM's tables are float32 NNX modules.
SKIPPED = {"dlrm": ("table_bf16", "table_bf16_sr")}


def matrix_factorisation(
  seed: int, options: dict, *, steps: int = 1000, every: int = 50, lr: float = 0.01
):
  """Held-out RMSE of examples/train_embedding.py's recommender: final, and every `every` steps.

  A `table_dtype` option stores both tables in it (rows read in float32: float32
  math and gradients, the table's dtype for storage).
  """
  import train_embedding as mf

  options = dict(options)
  table_dtype = options.pop("table_dtype", jnp.float32)
  n_users, n_items, dim, batch = 50_000, 20_000, 32, 4096
  rng = np.random.default_rng(seed)
  users, items, ratings = mf.make_ratings(rng, n_users, n_items, 8, 2_000_000)
  n_test = 100_000
  test = (users[:n_test], items[:n_test], ratings[:n_test])
  train = (users[n_test:], items[n_test:], ratings[n_test:])
  key_u, key_i = jax.random.split(jax.random.key(seed))
  params = {
    "users": (0.1 * jax.random.normal(key_u, (n_users, dim))).astype(table_dtype),
    "items": (0.1 * jax.random.normal(key_i, (n_items, dim))).astype(table_dtype),
  }
  opt = osa.sparse_adam(learning_rate=lr, **options)
  state = opt.init(params)

  def loss_of_rows(user_rows, item_rows, ratings):
    return jnp.mean((jnp.sum(user_rows * item_rows, axis=-1) - ratings) ** 2)

  def step(params, state, user_ids, item_ids, ratings):
    rows = (
      params["users"][user_ids].astype(jnp.float32),
      params["items"][item_ids].astype(jnp.float32),
    )
    g_users, g_items = jax.grad(loss_of_rows, argnums=(0, 1))(*rows, ratings)
    grads = {
      "users": mf.row_gradient(g_users, user_ids, n_users),
      "items": mf.row_gradient(g_items, item_ids, n_items),
    }
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  @jax.jit
  def held_out_rmse(params):
    rows = (
      params["users"][test[0]].astype(jnp.float32),
      params["items"][test[1]].astype(jnp.float32),
    )
    return jnp.sqrt(loss_of_rows(*rows, test[2]))

  step = jax.jit(step, donate_argnums=(0, 1))
  curve = [float(held_out_rmse(params))]
  for t in range(1, steps + 1):
    picked = rng.integers(0, len(train[0]), batch)
    params, state = step(params, state, *(a[picked] for a in train))
    if t % every == 0:
      curve.append(float(held_out_rmse(params)))
  return curve[-1], list(range(0, steps + 1, every)), curve


def dlrm(seed: int, options: dict, *, steps: int = 300, last: int = 100, window: int = 20):
  """Progressive validation log loss of examples/dlrm_side_by_side.py's JAX DLRM (float32).

  Returns the mean over the `last` steps, and the curve: the mean of each `window` steps.
  """
  import dlrm_side_by_side as d
  from flax import nnx

  args = d.parse_args(["--dtype", "float32", "--seed", str(seed), "--steps", str(steps)])
  batches = d.make_batches(args)
  model = d.DLRM(args, nnx.Rngs(seed))
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(args.lr, **options), "dense": optax.adam(args.lr)},
    osa.table_labels(model),
  )
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, dense, bags, clicks):
    def loss_fn(model):
      return optax.sigmoid_binary_cross_entropy(model(dense, bags), clicks).mean()

    loss, grads = osa.sparse_value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = []
  for dense, bags, clicks in batches:
    jax_bags = [(jnp.asarray(ids), jnp.asarray(offsets)) for ids, offsets in bags]
    losses.append(float(step(model, optimizer, jnp.asarray(dense), jax_bags, jnp.asarray(clicks))))
  curve = _curves.windowed(losses, window)
  return float(np.mean(losses[-last:])), list(range(window, steps + 1, window)), curve.tolist()


RECIPES = {
  "matrix factorisation, held-out RMSE": matrix_factorisation,
  "DLRM, progressive log loss (last 100 steps)": dlrm,
}
CURVES = {  # recipe: (panel title, y label)
  "matrix factorisation, held-out RMSE": (
    "matrix factorisation (train_embedding.py): held-out RMSE",
    "held-out RMSE",
  ),
  "DLRM, progressive log loss (last 100 steps)": (
    "DLRM (dlrm_side_by_side.py, float32): progressive log loss",
    "log loss of each fresh batch, mean of 20 steps",
  ),
}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. n-1")
  parser.add_argument("--json", action="store_true", help="print the figures as JSON only")
  parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
  parser.add_argument("--recipes", nargs="+", default=["mf", "dlrm"], choices=["mf", "dlrm"])
  parser.add_argument("--mf-steps", type=int, default=1000, help="matrix factorisation's steps")
  parser.add_argument("--mf-lr", type=float, default=0.01, help="matrix factorisation's lr")
  parser.add_argument(
    "--plot",
    nargs="?",
    type=Path,
    const=_curves.ROOT / "docs" / "lean_state_curves.png",
    help="draw the curves to this PNG (default docs/lean_state_curves.png)",
  )
  args = parser.parse_args(argv)
  seeds = list(range(args.seeds))
  start = time.perf_counter()
  if "full" not in args.settings:
    args.settings = ["full", *args.settings]  # the reference
  keys = dict(zip(RECIPES, ("mf", "dlrm"), strict=True))
  extra = {"mf": {"steps": args.mf_steps, "lr": args.mf_lr}, "dlrm": {}}
  runs = {
    recipe: {
      name: [run(s, SETTINGS[name], **extra[keys[recipe]]) for s in seeds]
      for name in args.settings
      if name not in SKIPPED.get(keys[recipe], ())
    }
    for recipe, run in RECIPES.items()
    if keys[recipe] in args.recipes
  }
  results = {
    recipe: {name: [final for final, _, _ in r] for name, r in by_setting.items()}
    for recipe, by_setting in runs.items()
  }
  if args.json:
    curves = {
      recipe: {name: [curve for _, _, curve in r] for name, r in by_setting.items()}
      for recipe, by_setting in runs.items()
    }
    json.dump({"final": results, "curves": curves}, sys.stdout)
    return
  seconds = time.perf_counter() - start
  print(f"# lean-state quality: seeds {seeds}; {seconds:.0f} s; {jax.default_backend()}")
  for recipe, by_setting in results.items():
    full = np.array(by_setting["full"])
    print(f"\n{recipe} (lower is better)\n")
    print(
      "| setting | mean | min .. max over seeds | vs full (mean) | per seed vs full "
      "| at most 1% above full | inside full's min..max |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, values in by_setting.items():
      v = np.array(values)
      per_seed = " ".join(f"{x:+.2%}" for x in v / full - 1)
      within = v.mean() <= 1.01 * full.mean()  # lower is better: below full passes
      inside = full.min() <= v.mean() <= full.max()
      print(
        f"| {name} | {v.mean():.4f} | {v.min():.4f} .. {v.max():.4f} "
        f"| {v.mean() / full.mean() - 1:+.2%} | {per_seed} | {'yes' if within else 'no'} "
        f"| {'yes' if inside else 'no'} |"
      )
  absolute, relative = [], []
  for recipe, by_setting in runs.items():
    steps = next(iter(by_setting.values()))[0][1]
    curves = {name: [curve for _, _, curve in r] for name, r in by_setting.items()}
    full = np.array(curves["full"])
    against_full = {  # each seed against full Adam with the same seed, in percent
      name: (100 * (np.array(c) / full - 1)).tolist() for name, c in curves.items()
    }
    title, ylabel = CURVES[recipe]
    _curves.print_curves(f"{title}, over training", steps, curves)
    _curves.print_curves(f"{title}, % against full Adam (same seed)", steps, against_full)
    absolute.append({"steps": steps, "curves": curves, "title": title, "ylabel": ylabel})
    relative.append(
      {
        "steps": steps,
        "curves": against_full,
        "title": f"{title.split(' (')[0]}: each seed against full Adam's",
        "ylabel": "% above full Adam (same seed)",
      }
    )
  if args.plot:
    _curves.plot_panels(
      args.plot,
      absolute + relative,
      columns=2,
      title=f"lean optimizer states against full Adam: mean and min..max over seeds {seeds}",
    )


if __name__ == "__main__":
  main()
