"""Static checks as tests, so that CI (which runs pytest) runs them: ruff, mypy, the docs build.

Each runs the tool in a subprocess from the repository root, with the configuration in
``pyproject.toml`` (ruff, mypy) and ``docs/conf.py`` (Sphinx). The tools come with the ``test``
extra; without them a check is skipped, except under CI (``CI`` set), where it fails. The test
tiers (``tests/conftest.py``) are checked here too.
"""

import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from . import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _require(module: str) -> None:
  if importlib.util.find_spec(module) is None:
    message = f"{module} is not installed: pip install -e '.[test]'"
    if os.environ.get("CI"):
      pytest.fail(message)
    pytest.skip(message)


def _run(*args: str, timeout: float = 300) -> None:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # conftest's 8 host devices are for the tests, not the tools
  result = subprocess.run(
    [sys.executable, "-m", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
  )
  if result.returncode != 0:
    pytest.fail(f"`{' '.join(args)}` failed:\n{result.stdout}\n{result.stderr}", pytrace=False)


def test_ruff_lint():
  _require("ruff")
  _run("ruff", "check", "--no-cache", ".")


def test_ruff_format():
  _require("ruff")
  _run("ruff", "format", "--no-cache", "--check", ".")


def test_mypy():
  """Type-checks jmp_lite/ (``[tool.mypy]`` in pyproject.toml); no errors allowed."""
  _require("mypy")
  _run("mypy", "--no-error-summary", timeout=600)


def _third_party_imports() -> set[str]:
  """The top-level modules jmp_lite/ imports from outside the standard library."""
  names = set()
  for path in (ROOT / "jmp_lite").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names.update(alias.name.split(".")[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names.add(node.module.split(".")[0])
  return names - set(sys.stdlib_module_names) - {"__future__", "jmp_lite"}


def _installed_by(requirements: list[str]) -> set[str]:
  """The distributions that installing ``requirements`` brings (as far as installed here)."""
  seen: set[str] = set()
  todo = list(requirements)
  while todo:
    req = Requirement(todo.pop())
    name = canonicalize_name(req.name)
    if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
      continue
    seen.add(name)
    try:
      todo.extend(importlib.metadata.requires(req.name) or [])
    except importlib.metadata.PackageNotFoundError:
      pass
  return seen


def test_mypy_needs_only_the_test_extra():
  """test_mypy passes with ``pip install -e .[test]`` alone (CI): every module jmp_lite imports
  that the runtime dependencies and the test extra do not install (matplotlib, from the examples
  extra) has ``ignore_missing_imports`` in ``[tool.mypy]``."""
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  project = config["project"]
  installed = _installed_by(project["dependencies"] + project["optional-dependencies"]["test"])
  dists = importlib.metadata.packages_distributions()
  ignored = {
    module
    for override in config["tool"]["mypy"].get("overrides", [])
    if override.get("ignore_missing_imports")
    for module in override["module"]
  }
  uncovered = sorted(
    name
    for name in _third_party_imports()
    if not {canonicalize_name(d) for d in dists.get(name, [])} & installed
    and not {name, f"{name}.*"} <= ignored
  )
  assert uncovered == []


def test_docs_build(tmp_path):
  """The documentation builds from a clean checkout with warnings as errors."""
  for module in ("sphinx", "myst_parser", "sphinx_book_theme"):
    _require(module)
  _run("sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(tmp_path / "html"))
  assert (tmp_path / "html" / "api" / "jmp_lite.html").exists()


# A test file runs a script of benchmarks/ or examples/ when it imports one at module level or
# loads one by path.
_RUNS_A_SCRIPT = re.compile(
  r"^(?:from|import) (?:benchmarks|examples)\b|[\"']benchmarks[\"'] /", re.M
)


def test_tier_table_lists_existing_files_once():
  listed = [path for paths in conftest.TIERS.values() for path in paths]
  assert sorted(p for p in listed if not (ROOT / "tests" / p).is_file()) == []
  assert sorted(p for p in set(listed) if listed.count(p) > 1) == []
  assert conftest.tier_of(ROOT / "tests" / "test_packaging.py") == "release"
  assert conftest.tier_of(ROOT / "tests" / "test_dtypes.py") == "unit"  # not listed


def test_tests_that_run_scripts_are_in_the_benchmark_tier():
  tests = ROOT / "tests"
  runs_scripts = {
    path.relative_to(tests).as_posix()
    for path in tests.rglob("test_*.py")
    if _RUNS_A_SCRIPT.search(path.read_text())
  }
  assert "test_examples.py" in runs_scripts and "flax/test_memory_benchmark.py" in runs_scripts
  assert sorted(runs_scripts - set(conftest.TIERS["benchmark"])) == []


def test_tier_markers_are_registered():
  """``pytest -m unit`` selects by a marker ``--strict-markers`` knows; each tier has one."""
  pytest_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
  markers = {line.split(":")[0] for line in pytest_config["ini_options"]["markers"]}
  assert markers == {"unit", *conftest.TIERS}
  assert "--strict-markers" in pytest_config["ini_options"]["addopts"].split()
