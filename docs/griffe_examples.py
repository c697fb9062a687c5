"""Griffe extension: the package's docstrings, read as the docs site renders them.

- The docstrings follow optax's order and name the section `Example:`; griffe's
  Google-style parser reads only `Examples:` as doctests (else the `>>>` lines
  become Markdown prose), so the heading is renamed before parsing.
- reStructuredText math (`:math:` roles, `.. math::` blocks, as in optax) is shown
  as code: the site renders no LaTeX, so that it builds and reads offline.
"""

import re

import griffe

_HEADING = re.compile(r"^Example:$", re.MULTILINE)
_ROLE = re.compile(r":math:`([^`]*)`")
_BLOCK = re.compile(r"^\.\. math::\n((?:[ \t]+.*\n?|\n)+)", re.MULTILINE)


def _math_block(match: re.Match) -> str:
  lines = [line.strip() for line in match.group(1).strip("\n").splitlines()]
  body = "\n".join(line.rstrip("\\").rstrip() for line in lines)
  return f"```text\n{body}\n```\n\n"


class ExampleSections(griffe.Extension):
  def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
    if obj.docstring is not None:
      text = _HEADING.sub("Examples:", obj.docstring.value)
      text = _BLOCK.sub(_math_block, text)
      obj.docstring.value = _ROLE.sub(r"`\1`", text)
