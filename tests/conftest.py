"""Test configuration: 8 host CPU devices for the multi-device tests, and the test tiers.

The device flags must be set before JAX initialises its backend, which conftest.py does.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = ["--xla_force_host_platform_device_count=8"]
if os.environ["JAX_PLATFORMS"] == "cpu":
  # The tests check values and graphs, not speed: most of their time is XLA:CPU compiling
  # small programs, which these two flags halve (LLVM optimizations and the fusion emitters).
  _flags += ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given, *(f for f in _flags if f not in _given)]).strip()

from hypothesis import settings  # noqa: E402

# CI has 2 cores; keep property tests small but meaningful and deterministic.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("ci")


import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TESTS = _ROOT / "tests"

# The test tiers, assigned here and nowhere else (markers registered in pyproject.toml):
#   unit       fast tests of the library: every test file not listed below;
#   release    the release checks: ruff, mypy, the Sphinx build, the sdist and wheel;
#   benchmark  the scripts under benchmarks/ and examples/, run end to end at tiny sizes.
# `pytest -m unit` runs the unit tier alone; README's command (and CI) runs all three.
# tests/test_static_checks.py checks that every file listed exists and that every file that
# imports a script from benchmarks/ or examples/ is in the benchmark tier.
TIERS: dict[str, tuple[str, ...]] = {
  "release": (
    "test_static_checks.py",
    "test_packaging.py",
  ),
  "benchmark": (
    "test_deviceless_benchmark.py",
    "test_examples.py",
    "test_fp8_benchmarks.py",
    "test_gpu_benchmark.py",
    "test_layerwise_experiment.py",
    "test_low_precision_params_benchmark.py",
    "flax/test_memory_benchmark.py",
    "flax/test_proxies_benchmark.py",
  ),
}
_TIER_OF = {path: tier for tier, paths in TIERS.items() for path in paths}


def tier_of(path: pathlib.Path) -> str:
  """The tier of the test file at ``path``: its entry in ``TIERS``, or ``"unit"``."""
  path = path.resolve()
  if not path.is_relative_to(_TESTS):  # e.g. doctests collected from jmp_lite/
    return "unit"
  return _TIER_OF.get(path.relative_to(_TESTS).as_posix(), "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  for item in items:
    item.add_marker(tier_of(item.path))


@pytest.fixture
def multi_device_env() -> dict[str, str]:
  """The environment of a subprocess with 8 host CPU devices that imports this checkout.

  Each multi-device case runs in a process of its own: on a 2-core machine several 8-device
  steps in one process can abort.
  """
  flags = [
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_collective_call_terminate_timeout_seconds=300",  # slow, not stuck, on 2 cores
    # Values, not speed, are checked: compile with XLA:CPU's backend optimizations off.
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
  ]
  path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), "PYTHONPATH": path}


@pytest.fixture
def run_on_8_devices(multi_device_env) -> Callable[..., dict]:
  """Runs ``python ARGS...`` on 8 host CPU devices and returns the JSON of its last line.

  E.g. ``run_on_8_devices("-c", SCRIPT, "case")`` or ``run_on_8_devices(WORKER_PATH, "case")``.
  """

  def run(*args: str) -> dict:
    result = subprocess.run(
      [sys.executable, *args],
      env=multi_device_env,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])

  return run
