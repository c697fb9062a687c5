"""Every ```python block of README.md and docs/**/*.md runs, and prints what its page says.

Conventions (docs/contributing.md):
- a block is complete: its own imports, no names from other blocks;
- a ```text block right after it is the block's expected stdout (doctest's `...` ellipsis
  and whitespace normalisation apply);
- a first line `# requires: flax` (or `torch`, or any importable module) skips the block
  only where that module is absent.
Each block runs in a fresh namespace, in this process (imports are shared, names are not).
"""

import contextlib
import doctest
import io
import pathlib
import re
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_REQUIRES = re.compile(r"^# requires: ([\w.]+(?:, *[\w.]+)*)$")
# Extras of pyproject.toml by the module they provide.
_EXTRA_MODULES = {"flax": "flax", "torch": "torch", "orbax": "orbax.checkpoint"}


def _blocks(page: pathlib.Path):
  """(line, code, expected stdout or None) of each python block of `page`."""
  text = page.read_text()
  fences = list(_FENCE.finditer(text))
  for i, fence in enumerate(fences):
    if fence.group(1) != "python":
      continue
    expected = None
    if i + 1 < len(fences):
      after = fences[i + 1]
      between = text[fence.end() : after.start()]
      if after.group(1) == "text" and not between.strip():
        expected = after.group(2)
    yield text[: fence.start()].count("\n") + 1, fence.group(2), expected


SNIPPETS = [
  pytest.param(code, expected, id=f"{page.relative_to(ROOT)}:{line}")
  for page in PAGES
  for line, code, expected in _blocks(page)
]


def test_the_pages_have_snippets():
  pages_with_code = {s.id.split(":")[0] for s in SNIPPETS}
  assert "README.md" in pages_with_code
  assert len(SNIPPETS) >= 20, len(SNIPPETS)


@pytest.mark.parametrize("code, expected", SNIPPETS)
def test_snippet_runs_and_prints_what_the_page_says(code, expected):
  first_line = code.splitlines()[0] if code else ""
  requires = _REQUIRES.match(first_line)
  if requires:
    for name in requires.group(1).split(","):
      pytest.importorskip(_EXTRA_MODULES.get(name.strip(), name.strip()))
  stdout = io.StringIO()
  namespace = {"__name__": "__main__"}
  with contextlib.redirect_stdout(stdout), warnings.catch_warnings():
    # On one CPU device XLA may decline to reuse a donated buffer; snippets donate as
    # real training steps should, so that warning is not a failure of the page.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 -- the docs' own code
  printed = stdout.getvalue()
  assert printed.strip(), "the snippet prints nothing: a reader cannot tell that it worked"
  if expected is not None:
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    assert checker.check_output(expected, printed, flags), (
      f"the snippet printed\n{printed}\nbut its page shows\n{expected}"
    )
