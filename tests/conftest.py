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
