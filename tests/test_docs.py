"""The guides' code runs, and the generated parts of the docs cover the code.

Every ```python block in ``docs/`` is run: it must be directly preceded by a line
``<!-- tested ... -->`` (test_every_python_block_is_tested), and the blocks of one page run in
order in one namespace. A marker saying ``(needs MODULE)`` runs its block only where ``MODULE``
can be imported (an optional dependency). (The full docs build, warnings as errors, is in
``test_static_checks.py``.)
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jmp_lite

os.environ.setdefault("MPLBACKEND", "Agg")  # the plots a page draws go nowhere

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TESTED_BLOCK = re.compile(r"^<!-- tested([^\n]*)-->\n```python\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"\(needs ([\w.]+)\)")
PAGES = sorted(p.name for p in DOCS.glob("*.md") if TESTED_BLOCK.search(p.read_text()))
# Pages whose blocks run multi-device steps, each run in a process of its own with this many
# host devices, since a 2-core machine can abort the third 8-device step in one process
# ("Termination timeout").
OWN_PROCESS = {"multi-device.md": 8, "migrating-from-flax.md": 2}
# A fence whose code Sphinx or a reader takes for Python: it must be spelled ```python and be
# tested. (Output and error text go in ```text or bare ``` fences.)
PYTHON_FENCE = re.compile(
  r"^```[ \t]*(?:\{code(?:-block|-cell)?\}[ \t]*)?(?:python3?|py|ipython)\b", re.M
)


def run_page(page: str, text: str) -> list[str]:
  """Runs the tested blocks of ``text`` (the page ``page``) in order, in one namespace.

  Returns:
    A line per block that was not run for want of the module its marker needs.
  """
  namespace: dict = {"__name__": f"docs.{page}"}
  not_run = []
  for match in TESTED_BLOCK.finditer(text):
    line = text.count("\n", 0, match.start(2)) + 1
    needs = NEEDS.search(match.group(1))
    if needs and importlib.util.find_spec(needs.group(1)) is None:
      not_run.append(f"{page}:{line} needs {needs.group(1)}")
      continue
    # Padding keeps tracebacks pointing at the right line of the page.
    code = "\n" * (line - 1) + match.group(2)
    exec(compile(code, str(DOCS / page), "exec"), namespace)
  return not_run


def run_page_in_process(page: str, text: str, env: dict[str, str]) -> None:
  """:func:`run_page` in a new Python process with the environment ``env``."""
  # From the repository root: run from tests/, the folder tests/flax would shadow Flax itself.
  script = "import sys, tests.test_docs as t; t.run_page(sys.argv[1], sys.stdin.read())"
  result = subprocess.run(
    [sys.executable, "-c", script, page],
    input=text,
    cwd=pathlib.Path(__file__).parents[1],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-4000:]


def with_devices(env: dict[str, str], count: int) -> dict[str, str]:
  """``env`` (8 host devices) with ``count`` host devices instead."""
  flag = "--xla_force_host_platform_device_count="
  assert f"{flag}8" in env["XLA_FLAGS"]
  return {**env, "XLA_FLAGS": env["XLA_FLAGS"].replace(f"{flag}8", f"{flag}{count}")}


def test_guides_have_tested_examples():
  assert {"getting-started.md", "recipe.md", "multi-device.md", "checkpointing.md"} <= set(PAGES)


SOURCES = sorted(
  p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_build" not in p.parts
)


@pytest.mark.parametrize("page", SOURCES)
def test_every_python_block_is_tested(page):
  text = (DOCS / page).read_text()
  fences = [text.count("\n", 0, m.start()) + 1 for m in PYTHON_FENCE.finditer(text)]
  tested = [text.count("\n", 0, m.start(2)) for m in TESTED_BLOCK.finditer(text)]
  untested = sorted(set(fences) - set(tested))
  assert not untested, (
    f"{page}: the ```python blocks at lines {untested} are not run by the tests: put a line "
    "<!-- tested ... --> right above each (or make a block that is not Python a ```text one)"
  )
  markers = len(re.findall(r"^<!-- tested", text, re.M))
  assert markers == len(tested), f"{page}: a <!-- tested --> line not right above ```python"


@pytest.mark.parametrize("page", sorted(set(PAGES) - set(OWN_PROCESS)))
def test_guide_examples_run(page, capsys):
  not_run = run_page(page, (DOCS / page).read_text())
  if "matplotlib.pyplot" in sys.modules:  # the figures a page drew
    sys.modules["matplotlib.pyplot"].close("all")
  if not_run:
    pytest.skip(f"the other blocks ran; not run: {', '.join(not_run)}")


@pytest.mark.parametrize("page", sorted(set(OWN_PROCESS) - {"multi-device.md"}))
def test_multi_device_guide_examples_run(page, multi_device_env):
  env = with_devices(multi_device_env, OWN_PROCESS[page])
  run_page_in_process(page, (DOCS / page).read_text(), env)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_multi_device_guide_runs_under_both_axis_types(axis_type, multi_device_env):
  # The page builds its mesh with explicit axes (make_mesh's default); it must also run with
  # auto axes, so the run under "Auto" swaps them in.
  text = (DOCS / "multi-device.md").read_text()
  assert "AxisType.Explicit" in text
  text = text.replace("AxisType.Explicit", f"AxisType.{axis_type}")
  env = with_devices(multi_device_env, OWN_PROCESS["multi-device.md"])
  run_page_in_process("multi-device.md", text, env)


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


def _slug(heading: str) -> str:
  """The anchor MyST (``myst_heading_anchors``) and GitHub give a heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_training_step_links_to_its_tested_version():
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## A training step", 1)[1].split("\n## ", 1)[0]
  links = re.findall(r"\]\((docs/[\w-]+\.md)#([\w-]+)\)", section)
  assert links, "README's training step links to no complete version in docs/"
  for page, anchor in links:
    parts = re.split(r"^#+ (.*)$", (ROOT / page).read_text(), flags=re.M)
    bodies = {_slug(title): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}
    assert anchor in bodies, f"{page} has no heading #{anchor}"
    assert TESTED_BLOCK.search(bodies[anchor]), f"{page}#{anchor} has no tested block"


def test_readme_links_resolve():
  readme = (ROOT / "README.md").read_text()
  for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
    if not target.startswith("http"):
      assert (ROOT / target).exists(), f"README links to missing {target}"
