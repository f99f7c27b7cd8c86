"""The ``>>>`` examples in jmp_lite's docstrings run, so they cannot rot.

Every module of the package is searched (public or not). Examples may use ``jax``, ``jnp``,
``np``, ``optax`` and ``jl`` (``import jmp_lite as jl``) without importing them, as the
documentation's examples do; everything else must be imported in the example.
"""

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import tokenize

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite

from .package_testing import NAMESPACES

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
GLOBALS = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jl": jmp_lite}


def _examples(module_name: str) -> list[doctest.DocTest]:
  module = importlib.import_module(module_name)
  tests = doctest.DocTestFinder(exclude_empty=True).find(module, module_name, extraglobs=GLOBALS)
  return [t for t in tests if t.examples]


ALL_MODULES = [
  "jmp_lite",
  *sorted(info.name for info in pkgutil.walk_packages(jmp_lite.__path__, prefix="jmp_lite.")),
]
MODULES_WITH_EXAMPLES = [name for name in ALL_MODULES if _examples(name)]


@pytest.mark.parametrize("module_name", MODULES_WITH_EXAMPLES)
def test_docstring_examples(module_name):
  tests = _examples(module_name)
  runner = doctest.DocTestRunner(optionflags=OPTIONS)
  for test in tests:
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed (see above)"


def test_examples_are_found():
  # Every module of the package is searched: one per .py file under jmp_lite/.
  root = pathlib.Path(jmp_lite.__file__).parent
  files = [p.relative_to(root.parent).with_suffix("").parts for p in root.rglob("*.py")]
  assert sorted(ALL_MODULES) == sorted(
    ".".join(f[:-1] if f[-1] == "__init__" else f) for f in files
  )
  assert "jmp_lite.flax._linen" in ALL_MODULES
  assert {"jmp_lite._policy", "jmp_lite._loss_scale._dynamic"} <= set(MODULES_WITH_EXAMPLES)
  assert any(name.startswith("jmp_lite.fp8.") for name in MODULES_WITH_EXAMPLES)


def test_the_public_api_has_examples():
  """The entry points a new user meets first each show an example."""
  for name in (
    "Policy",
    "get_policy",
    "DynamicLossScale",
    "StaticLossScale",
    "all_finite",
    "format_info",
    "parse_dtype",
  ):
    assert ">>>" in getattr(jmp_lite, name).__doc__, name
  for name in ("policy_apply", "policy_view"):
    assert ">>>" in getattr(jmp_lite.flax, name).__doc__, name


def _public_functions():
  """(qualified name, function) for every public function and public method exported."""
  for namespace in NAMESPACES:
    module = importlib.import_module(namespace)
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isclass(obj):
        for attr, member in vars(obj).items():
          # Methods Flax generates (a struct's `replace`) are Flax's to document.
          ours = getattr(member, "__module__", "").startswith("jmp_lite")
          if inspect.isfunction(member) and not attr.startswith("_") and ours:
            yield f"{namespace}.{name}.{attr}", member
      elif inspect.isfunction(obj):
        yield f"{namespace}.{name}", obj


def _undocumented_sections(fn) -> list[str]:
  doc = inspect.getdoc(fn) or ""
  parameters = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
  returns = inspect.signature(fn).return_annotation not in (None, "None")
  missing = [] if doc.strip() else ["summary"]
  if parameters and "Args:" not in doc:
    missing.append("Args:")
  if returns and "Returns:" not in doc and "Yields:" not in doc:
    missing.append("Returns:")
  return missing


def test_public_functions_state_args_and_returns():
  """optax's form: a summary, then ``Args:`` and ``Returns:`` wherever they apply."""
  missing = {name: m for name, fn in _public_functions() if (m := _undocumented_sections(fn))}
  assert missing == {}


def test_docstrings_with_backslashes_are_raw():
  """Math in docstrings is written in ``r\"\"\"`` strings, never with doubled backslashes."""
  offenders = []
  for path in sorted(pathlib.Path(jmp_lite.__file__).parent.rglob("*.py")):
    with tokenize.open(path) as f:
      for token in tokenize.generate_tokens(f.readline):
        text = token.string
        if token.type == tokenize.STRING and text.startswith('"""') and "\\\\" in text:
          offenders.append(f"{path.relative_to(path.parents[1])}:{token.start[0]}")
  assert offenders == []
