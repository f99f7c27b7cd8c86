"""Static checks as tests, so that CI (which runs pytest) runs them: ruff, mypy, the docs build.

Each runs the tool in a subprocess from the repository root, with the configuration in
``pyproject.toml`` (ruff, mypy) and ``docs/conf.py`` (Sphinx). The tools come with the ``test``
extra; without them a check is skipped, except under CI (``CI`` set), where it fails.
"""

import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
