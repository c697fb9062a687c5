"""MkDocs hook: the examples gallery, generated from each example's Gallery block.

The block (parsed by examples/_gallery.py, which the examples themselves use to
check their extras) is the one source of an example's extras, what it shows and
its measured run time.
"""

import importlib.util
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_MARKER = "<!-- gallery -->"
_MAIN = "train_embedding"


def _gallery_module():
  spec = importlib.util.spec_from_file_location("_gallery", _ROOT / "examples" / "_gallery.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def gallery_markdown() -> str:
  """The gallery's Markdown: one section per example."""
  gallery = _gallery_module()
  sections = []
  # The main example (the README's) first, then the others by file name.
  metas = sorted(gallery.all_examples(_ROOT / "examples"), key=lambda m: m.name != _MAIN)
  for meta in metas:
    extras = ", ".join(f"`{e}`" for e in meta.extras) or "none (the base install)"
    lines = [
      f"## {meta.title}",
      "",
      f"`python examples/{meta.name}.py`",
      "",
      f"- **Shows:** {meta.shows}",
      f"- **Extras:** {extras}; install with `{gallery.install_command(meta.extras)}`",
    ]
    if meta.optional_extras:
      optional = ", ".join(f"`{e}`" for e in meta.optional_extras)
      lines.append(f"- **Optional extras:** {optional} (the script runs without them)")
    lines.append(f"- **Run time:** {meta.run_time}")
    sections.append("\n".join(lines))
  return "\n\n".join(sections)


def on_page_markdown(markdown, page, **kwargs):
  if _MARKER in markdown:
    return markdown.replace(_MARKER, gallery_markdown())
  return markdown
