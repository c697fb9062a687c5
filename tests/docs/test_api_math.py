"""The API pages' docstrings as the docs site reads them: math as MathML, one Returns row.

The griffe extension (docs/griffe_examples.py) and the docstring options of mkdocs.yml,
applied to the package's own docstrings, without building the site.
"""

import importlib.util
import pathlib
import re

import pytest

pytest.importorskip("latex2mathml")  # in the docs extra, which the README's install has
griffe = pytest.importorskip("griffe")
yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _options():
  class _Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python tags; none matter here
    pass

  _Loader.add_multi_constructor("", lambda loader, suffix, node: None)
  config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
  handler = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]["options"]
  return handler.get("docstring_options", {})


@pytest.fixture(scope="module")
def package():
  spec = importlib.util.spec_from_file_location("griffe_examples", ROOT / "docs/griffe_examples.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  extensions = griffe.load_extensions(module.ExampleSections())
  return griffe.load("optax_sparse_adam", search_paths=[str(ROOT)], extensions=extensions)


@pytest.mark.parametrize("name", ["_optax.transform.sparse_adam", "_optax.transform.sparse_adamw"])
def test_returns_is_one_row(package, name):
  sections = package[name].docstring.parse("google", **_options())
  returns = [s for s in sections if s.kind.value == "returns"]
  assert len(returns) == 1 and len(returns[0].value) == 1, [r.description for r in returns[0].value]
  assert "SparseAdamState" in returns[0].value[0].description


@pytest.mark.parametrize(
  "name",
  [
    "_optax.transform.sparse_adam",
    "_optax.optimizers.sparse_adagrad",
    "_optax.rule_transform.sparse_rule_transformation",
    "torch_compat._sparse_adam.SparseAdam",
  ],
)
def test_math_is_mathml_not_latex(package, name):
  text = package[name].docstring.value
  assert ".. math::" not in text and ":math:" not in text
  assert '<div class="math-block"><math' in text
  blocks = re.findall(r'<div class="math-block">(.*?)</div>', text)
  for block in blocks:
    assert "\\" not in block, block  # no LaTeX command left unconverted
    assert block.count("<math") == 1 and "\n" not in block


def test_aligned_lines_stay_aligned_and_roles_are_inline(package):
  text = package["_optax.transform.sparse_adam"].docstring.value
  assert "<mtable" in text and text.count("<mtr>") == 4  # the four lines of the update
  # :math:`m`, :math:`v`, ... inline, in a span (a line starting with `<math` is a block).
  assert (
    '<span class="math"><math xmlns="http://www.w3.org/1998/Math/MathML" display="inline">' in text
  )
