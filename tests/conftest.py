"""Test configuration: 8 host CPU devices for the multi-device tests.

This must run before JAX initialises its backend, which conftest.py does.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

from hypothesis import settings  # noqa: E402

# CI has 2 cores; keep property tests small but meaningful and deterministic.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("ci")


import pathlib  # noqa: E402

import pytest  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parents[1]


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
  ]
  path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), "PYTHONPATH": path}
