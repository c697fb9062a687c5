"""Griffe extension: the package's docstrings, read as the docs site renders them.

- The docstrings follow optax's order and name the section `Example:`; griffe's
  Google-style parser reads only `Examples:` as doctests (else the `>>>` lines
  become Markdown prose), so the heading is renamed before parsing.
- reStructuredText math (`:math:` roles, `.. math::` blocks, as in optax) is
  converted to MathML when the site is built (`latex2mathml`, in the `docs` extra):
  browsers draw MathML themselves, so the pages need no script, no font and no
  network to show the formulas. A block whose lines align on `&` is a `split`.
"""

import re

import griffe

try:
  from latex2mathml.converter import convert as _latex_to_mathml
except ModuleNotFoundError as error:  # pragma: no cover - the docs extra installs it
  raise ModuleNotFoundError(
    "The docs render the docstrings' math with latex2mathml: pip install -e '.[docs]'"
  ) from error

_HEADING = re.compile(r"^Example:$", re.MULTILINE)
_ROLE = re.compile(r":math:`([^`]*)`")
_BLOCK = re.compile(r"^\.\. math::\n((?:[ \t]+.*\n?|\n)+)", re.MULTILINE)


_TEXT_UNDERSCORE = re.compile(r"(\\text\{[^}]*?)\\_")


def _mathml(latex: str, display: str) -> str:
  """MathML of `latex` on one line (`\\_` inside `\\text{}` read as `_`, as LaTeX prints it)."""
  while _TEXT_UNDERSCORE.search(latex):
    latex = _TEXT_UNDERSCORE.sub(r"\1_", latex)
  return _latex_to_mathml(latex, display=display).replace("\n", "")


def _math_block(match: re.Match) -> str:
  latex = " ".join(line.strip() for line in match.group(1).strip("\n").splitlines())
  if "&" in latex or "\\\\" in latex:
    latex = rf"\begin{{split}}{latex}\end{{split}}"
  # A raw HTML block (a blank line on each side) that Markdown passes through untouched.
  return f'<div class="math-block">{_mathml(latex, "block")}</div>\n\n'


def _math_role(match: re.Match) -> str:
  # In a span: Markdown reads a line that starts with `<math` as a block of raw HTML.
  return f'<span class="math">{_mathml(match.group(1), "inline")}</span>'


class ExampleSections(griffe.Extension):
  def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
    if obj.docstring is not None:
      text = _HEADING.sub("Examples:", obj.docstring.value)
      text = _BLOCK.sub(_math_block, text)
      obj.docstring.value = _ROLE.sub(_math_role, text)
