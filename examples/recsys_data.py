"""Ratings for the recommender examples: synthetic (Zipf popularity, planted taste) or MovieLens.

Shared by `recommender_nnx.py` and `recommender_linen.py`; not an example by itself.
"""

import re
from typing import NamedTuple

import numpy as np


class Ratings(NamedTuple):
  """Ratings with contiguous ids: `users[k]` rated `items[k]` with `ratings[k]`."""

  users: np.ndarray
  items: np.ndarray
  ratings: np.ndarray
  num_users: int
  num_items: int

  def split(self, test_fraction: float, seed: int) -> tuple["Ratings", "Ratings"]:
    order = np.random.default_rng(seed).permutation(len(self.ratings))
    cut = int(len(order) * (1 - test_fraction))

    def take(idx):
      return Ratings(
        self.users[idx], self.items[idx], self.ratings[idx], self.num_users, self.num_items
      )

    return take(order[:cut]), take(order[cut:])


def _zipf_ids(rng: np.random.Generator, num_ids: int, size: int, exponent: float) -> np.ndarray:
  # Popularity rank r has weight r^-exponent; ranks are shuffled over the ids.
  weights = np.arange(1, num_ids + 1, dtype=np.float64) ** -exponent
  ranks = rng.choice(num_ids, size=size, p=weights / weights.sum())
  return rng.permutation(num_ids)[ranks].astype(np.int32)


def synthetic_ratings(
  num_users: int, num_items: int, num_ratings: int, *, rank: int = 8, seed: int = 0
) -> Ratings:
  """Ratings 1..5 from a planted low-rank taste model, with Zipf-distributed users and items.

  A rating is `3 + u_user . v_item / sqrt(rank) + b_item + noise`, rounded and
  clipped to 1..5: a model that learns the factors can approach the noise floor.
  """
  rng = np.random.default_rng(seed)
  users = _zipf_ids(rng, num_users, num_ratings, exponent=1.05)
  items = _zipf_ids(rng, num_items, num_ratings, exponent=1.1)
  user_factors = rng.normal(size=(num_users, rank)).astype(np.float32)
  item_factors = rng.normal(size=(num_items, rank)).astype(np.float32)
  item_bias = rng.normal(scale=0.5, size=num_items).astype(np.float32)
  score = np.einsum("nr,nr->n", user_factors[users], item_factors[items]) / np.sqrt(rank)
  noise = rng.normal(scale=0.3, size=num_ratings)
  ratings = np.clip(np.round(3.0 + score + item_bias[items] + noise), 1, 5).astype(np.float32)
  return Ratings(users, items, ratings, num_users, num_items)


def read_movielens(path: str) -> Ratings:
  """Reads `user,item,rating[,timestamp]` lines: MovieLens `ratings.csv`, `u.data` or `ratings.dat`.

  Fields may be separated by ',', tabs or '::'; a header line is skipped. Ids
  are remapped to contiguous ranges.
  """
  raw_users, raw_items, ratings = [], [], []
  with open(path) as f:
    for line_number, line in enumerate(f, 1):
      fields = [x for x in re.split(r"::|,|\t|\s+", line.strip()) if x]
      if not fields:
        continue
      if len(fields) < 3:
        raise ValueError(f"{path}:{line_number}: expected user,item,rating[,timestamp].")
      try:
        rating = float(fields[2])
      except ValueError:
        if line_number == 1:
          continue  # a header
        raise
      raw_users.append(fields[0])
      raw_items.append(fields[1])
      ratings.append(rating)
  user_ids, users = np.unique(np.asarray(raw_users), return_inverse=True)
  item_ids, items = np.unique(np.asarray(raw_items), return_inverse=True)
  return Ratings(
    users.astype(np.int32),
    items.astype(np.int32),
    np.asarray(ratings, np.float32),
    len(user_ids),
    len(item_ids),
  )


def print_curves(title: str, curves: dict[str, list[float]], every: int) -> None:
  """Prints losses side by side, one row per `every` steps (mean over the window)."""
  names = list(curves)
  print(f"\n{title}")
  print("  step  " + "".join(f"{name:>30}" for name in names))
  steps = len(next(iter(curves.values())))
  for end in range(every, steps + 1, every):
    row = "".join(f"{np.mean(curves[n][end - every : end]):>30.4f}" for n in names)
    print(f"{end:>6}  {row}")
