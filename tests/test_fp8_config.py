"""fp8 configuration (jmp_lite/_fp8_config.py): defaults, validation, the initial state."""

import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8

from .fp8_testing import (
  E4M3,
  E5M2,
)

# Configuration -------------------------------------------------------------------------


def test_config_defaults_and_hashable():
  config = fp8.Fp8Config()
  assert (config.fwd_dtype, config.bwd_dtype) == (E4M3, E5M2)
  assert config.amax_history_length == 1024
  assert config.amax_compute_algo == "max"
  assert config.margin == 0.0
  assert config.fast_accumulation == "none"
  assert fp8.Fp8Config("e4m3", "f8e5m2") == config
  assert hash(fp8.Fp8Config(margin=1)) == hash(fp8.Fp8Config(margin=1.0))


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"amax_history_length": 0}, ValueError, "amax_history_length must be >= 1, got 0"),
    ({"amax_history_length": -3}, ValueError, "got -3"),
    ({"amax_history_length": 2.0}, TypeError, "got 2.0"),
    ({"amax_history_length": True}, TypeError, "got True"),
    ({"margin": -1}, ValueError, "margin must be finite, >= 0 and < 64, got -1"),
    ({"margin": float("nan")}, ValueError, "got nan"),
    ({"margin": float("inf")}, ValueError, "got inf"),
    ({"margin": 100}, ValueError, "got 100"),
    ({"margin": "1"}, TypeError, "got '1'"),
    ({"margin": True}, TypeError, "got True"),
    ({"amax_compute_algo": "mean"}, ValueError, "got 'mean'"),
    ({"amax_compute_algo": None}, TypeError, "got None"),
    ({"fwd_dtype": "bf16"}, ValueError, "fwd_dtype must be an fp8 format .* got bfloat16"),
    ({"bwd_dtype": jnp.float16}, ValueError, "bwd_dtype must be an fp8 format .* got float16"),
    ({"fwd_dtype": jnp.int8}, TypeError, "int8"),
    ({"fwd_dtype": "float8_e4m3fnuz"}, ValueError, "float8_e4m3fnuz"),
    ({"bwd_dtype": None}, TypeError, "None"),
    ({"fast_accumulation": "backward"}, ValueError, "fast_accumulation must be one of"),
    ({"fast_accumulation": True}, TypeError, "got True"),
  ],
)
def test_config_rejects_bad_values(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.Fp8Config(**kwargs)


def test_init_state():
  state = fp8.init_dot_state(fp8.Fp8Config(amax_history_length=5))
  for tensor in state:
    assert tensor.scale.shape == () and tensor.scale.dtype == jnp.float32
    assert float(tensor.scale) == 0.0  # none yet: the first step quantizes with its own amax
    np.testing.assert_array_equal(tensor.amax_history, np.zeros(5, np.float32))
  with pytest.raises(ValueError, match="got 0"):
    fp8.init_scale_state(0)
