"""Static checks as tests, so that CI (which runs pytest) runs them: ruff, mypy, the docs build.

Each runs the tool in a subprocess from the repository root, with the configuration in
``pyproject.toml`` (ruff, mypy) and ``docs/conf.py`` (Sphinx). The tools come with the ``test``
extra; without them a check is skipped, except under CI (``CI`` set), where it fails.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

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


def test_docs_build(tmp_path):
  """The documentation builds from a clean checkout with warnings as errors."""
  for module in ("sphinx", "myst_parser", "sphinx_book_theme"):
    _require(module)
  _run("sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(tmp_path / "html"))
  assert (tmp_path / "html" / "api" / "jmp_lite.html").exists()
