"""The ``>>>`` examples in jmp_lite's docstrings run, so they cannot rot.

Every module of the package is searched (public or not). Examples may use ``jax``, ``jnp``,
``np``, ``optax`` and ``jl`` (``import jmp_lite as jl``) without importing them, as the
documentation's examples do; everything else must be imported in the example.
"""

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite

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
  assert len(ALL_MODULES) > 15 and "jmp_lite.flax.linen" in ALL_MODULES
  assert {"jmp_lite.policy", "jmp_lite.loss_scale", "jmp_lite.fp8"} <= set(MODULES_WITH_EXAMPLES)


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
