"""The guides' code runs, and the generated parts of the docs cover the code.

A ```python block directly preceded by a line ``<!-- tested ... -->`` in ``docs/*.md`` is run;
the blocks of one page run in order in one namespace. (The full docs build, warnings as errors,
is in ``test_static_checks.py``.)
"""

import pathlib
import re
import subprocess
import sys

import pytest

import jmp_lite

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TESTED_BLOCK = re.compile(r"^<!-- tested[^\n]*-->\n```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(p.name for p in DOCS.glob("*.md") if TESTED_BLOCK.search(p.read_text()))
# Pages whose blocks run several 8-device steps: each run in a process of its own, since a
# 2-core machine can abort the third such step in one process ("Termination timeout").
OWN_PROCESS = {"multi-device.md"}


def run_page(page: str, text: str) -> None:
  """Runs the tested blocks of ``text`` (the page ``page``) in order, in one namespace."""
  namespace: dict = {"__name__": f"docs.{page}"}
  for match in TESTED_BLOCK.finditer(text):
    line = text.count("\n", 0, match.start(1)) + 1
    # Padding keeps tracebacks pointing at the right line of the page.
    code = "\n" * (line - 1) + match.group(1)
    exec(compile(code, str(DOCS / page), "exec"), namespace)


def test_guides_have_tested_examples():
  assert {"getting-started.md", "recipe.md", "multi-device.md", "checkpointing.md"} <= set(PAGES)


@pytest.mark.parametrize("page", sorted(set(PAGES) - OWN_PROCESS))
def test_guide_examples_run(page, capsys):
  run_page(page, (DOCS / page).read_text())


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_multi_device_guide_runs_under_both_axis_types(axis_type, multi_device_env):
  # The page builds its mesh with explicit axes (make_mesh's default); it must also run with
  # auto axes, so the run under "Auto" swaps them in.
  text = (DOCS / "multi-device.md").read_text()
  assert "AxisType.Explicit" in text
  text = text.replace("AxisType.Explicit", f"AxisType.{axis_type}")
  script = "import sys, test_docs; test_docs.run_page('multi-device.md', sys.stdin.read())"
  result = subprocess.run(
    [sys.executable, "-c", script],
    input=text,
    cwd=pathlib.Path(__file__).parent,
    env=multi_device_env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def docs_ext():
  sys.path.insert(0, str(DOCS / "_ext"))
  try:
    import jmp_lite_docs

    yield jmp_lite_docs
  finally:
    sys.path.remove(str(DOCS / "_ext"))


def test_formats_table_is_generated_from_the_formats(docs_ext):
  table = "\n".join(docs_ext.formats_table())
  for name, info in jmp_lite.FORMATS.items():
    assert f"``{name}``" in table
    assert f"(1/{info.exponent_bits}/{info.mantissa_bits})" in table
  assert "65504" in table and "2^-24" in table and "448" in table and "57344" in table
  assert "yes" in table and "no" in table


# The API pages' directives: ```{jmp-lite-api} <module>, then the names it documents.
API_DIRECTIVE = re.compile(r"```\{jmp-lite-api\} (\S+)\n(.*?)```", re.S)
API_SECTIONS = [
  (f"{page.name}:{i}", module, body.split())
  for page in sorted((DOCS / "api").glob("*.md"))
  for i, (module, body) in enumerate(API_DIRECTIVE.findall(page.read_text()))
]


def test_api_pages_use_the_directive():
  assert {module for _, module, _ in API_SECTIONS} >= {"jmp_lite", "jmp_lite.diagnostics"}


@pytest.mark.parametrize("section", API_SECTIONS, ids=[s[0] for s in API_SECTIONS])
def test_api_directive_documents_every_name(docs_ext, section):
  """``jmp-lite-api`` writes one autodoc entry per name it is given (that the pages give it
  every exported name: tests/test_api_reference.py)."""
  _, module, names = section
  entries = "\n".join(docs_ext.api_entries(module, names))
  documented = re.findall(
    rf"^\.\. (?:auto\w+|py:data):: {re.escape(module)}\.(\w+)$", entries, re.M
  )
  assert documented == names


def test_docs_pages_are_in_the_toctree():
  index = (DOCS / "index.md").read_text()
  for page in DOCS.glob("*.md"):
    if page.stem != "index":
      assert re.search(rf"^{re.escape(page.stem)}$", index, re.M), f"{page.name} not in the toctree"


def _readme_step() -> str:
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## A training step", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_training_step_is_15_lines_and_runs():
  import jax
  import jax.numpy as jnp

  code = _readme_step()
  assert len(code.splitlines()) <= 15

  class Model:  # what the README leaves to the reader: a model, a loss, parameters
    def apply(self, params, x):
      return x @ params["w"]

  def cross_entropy(logits, labels):
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

  namespace = {"model": Model(), "cross_entropy": cross_entropy, "params": {"w": jnp.ones((4, 3))}}
  exec(compile(code, "README.md", "exec"), namespace)
  x, y = jnp.ones((2, 4)), jax.nn.one_hot(jnp.array([0, 2]), 3)
  params, opt_state, loss = namespace["train_step"](
    namespace["params"], namespace["opt_state"], x, y
  )
  assert params["w"].dtype == jnp.float32 and jnp.isfinite(loss)
  assert int(jmp_lite.get_loss_scaling_state(opt_state).steps) == 1


def test_readme_links_resolve():
  readme = (ROOT / "README.md").read_text()
  for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
    if not target.startswith("http"):
      assert (ROOT / target).exists(), f"README links to missing {target}"
