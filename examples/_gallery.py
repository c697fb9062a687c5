"""The examples' metadata: one `Gallery:` block in each example's module docstring.

    Gallery:
      title: Matrix factorisation in plain JAX and optax
      extras: examples
      optional extras: torch
      shows: what the example demonstrates, in one line
      run time: 6.9 s (where and how it was measured)

The docs site's gallery (docs/hooks.py) and each example's check for its extras
(`require_extras`) read this block, and tests/docs/test_examples_gallery.py checks it
against the script's imports, so the page and the script cannot disagree.
"""

import ast
import importlib
import sys
from pathlib import Path
from typing import NamedTuple

# The module each extra of pyproject.toml provides, tried by `require_extras`.
EXTRA_MODULES = {"flax": "flax", "torch": "torch", "examples": "tqdm"}
_KEYS = ("title", "extras", "optional extras", "shows", "run time")


class Meta(NamedTuple):
  """One example's gallery entry."""

  name: str
  title: str
  extras: tuple[str, ...]
  optional_extras: tuple[str, ...]
  shows: str
  run_time: str


def _extras(value: str) -> tuple[str, ...]:
  names = tuple(e.strip() for e in value.split(",") if e.strip() and e.strip() != "none")
  unknown = [e for e in names if e not in EXTRA_MODULES]
  if unknown:
    raise ValueError(f"unknown extras {unknown}; expected some of {sorted(EXTRA_MODULES)}")
  return names


def parse(docstring: str, name: str) -> Meta:
  """The `Gallery:` block of `docstring` (the module docstring of example `name`)."""
  lines = docstring.splitlines()
  if "Gallery:" not in [line.strip() for line in lines]:
    raise ValueError(f"{name}: its docstring has no 'Gallery:' block")
  start = [line.strip() for line in lines].index("Gallery:") + 1
  fields: dict[str, str] = {}
  key = None
  for line in lines[start:]:
    if not line.strip():
      break
    head, sep, value = line.strip().partition(":")
    if sep and head in _KEYS:
      key = head
      fields[key] = value.strip()
    elif key is not None:  # a continuation line
      fields[key] += " " + line.strip()
  missing = [k for k in _KEYS if k not in fields and k != "optional extras"]
  if missing:
    raise ValueError(f"{name}: the Gallery block lacks {missing}")
  return Meta(
    name=name,
    title=fields["title"],
    extras=_extras(fields["extras"]),
    optional_extras=_extras(fields.get("optional extras", "none")),
    shows=fields["shows"],
    run_time=fields["run time"],
  )


def install_command(extras: tuple[str, ...]) -> str:
  """The pip command that installs the package from a clone with `extras`."""
  return f'pip install -e ".[{",".join(extras)}]"' if extras else "pip install -e ."


def require_extras(docstring: str, script: str) -> Meta:
  """Exits with the pip command to run if a module of the example's extras is missing."""
  meta = parse(docstring, Path(script).stem)
  for extra in meta.extras:
    module = EXTRA_MODULES[extra]
    try:
      importlib.import_module(module)
    except ImportError:
      sys.exit(
        f"{Path(script).name} needs the [{extra}] extra ({module} is not installed). "
        f"From the repository root: {install_command(meta.extras)}"
      )
  return meta


def all_examples(directory: Path) -> list[Meta]:
  """The gallery entries of every example script in `directory`, by file name."""
  metas = []
  for path in sorted(directory.glob("*.py")):
    if path.name.startswith("_") or path.name == "recsys_data.py":
      continue
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    metas.append(parse(docstring, path.stem))
  return metas
