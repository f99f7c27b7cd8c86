"""fp8 quantization (jmp_lite/fp8/_quantize.py): rounding, error bounds, saturation, amax."""

import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8

from .fp8_testing import (
  E4M3,
  E5M2,
  FMT,
  all_values,
  nearest,
)

# Quantization --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 0.37])
def test_quantize_rounds_to_nearest_representable(dtype, scale):
  grid = all_values(dtype)
  fmt = FMT[dtype]
  rng = np.random.default_rng(0)
  # Magnitudes from below the smallest subnormal to the largest value, both signs.
  mags = np.exp(rng.uniform(np.log(fmt.min_subnormal / 4), np.log(fmt.max), 4000))
  v = (mags * rng.choice([-1, 1], mags.shape)).astype(np.float32)
  x = (v.astype(np.float64) * np.float32(scale)).astype(np.float32)
  q = fp8.quantize(x, scale, dtype)
  assert q.dtype == dtype
  ratio = x.astype(np.float64) / np.float64(np.float32(scale))
  np.testing.assert_array_equal(np.asarray(q, np.float64), nearest(ratio, grid))
  # Every representable value survives quantize-dequantize exactly (scale 1).
  np.testing.assert_array_equal(
    np.asarray(fp8.quantize_dequantize(grid.astype(np.float32), 1.0, dtype)), grid
  )


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantization_error_bound_per_format(dtype):
  """|qdq(x) - x| <= eps/2 |x| in the normal range, <= scale * min_subnormal / 2 below."""
  fmt = FMT[dtype]
  rng = np.random.default_rng(1)
  scale = np.float32(0.013)
  x = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 0, 20000))).astype(np.float32)
  x *= fmt.max * scale / np.abs(x).max()  # amax maps exactly to the top of the range
  err = np.abs(np.asarray(fp8.quantize_dequantize(x, scale, dtype), np.float64) - x)
  normal = np.abs(x) >= fmt.min_normal * scale
  assert normal.any() and (~normal).any()
  assert np.all(err[normal] <= fmt.epsilon / 2 * np.abs(x[normal]) * (1 + 1e-6))
  assert np.all(err[~normal] <= fmt.min_subnormal / 2 * scale * (1 + 1e-6))
  # The bound is nearly attained (its supremum is u / (1 + u), u = eps / 2): a finer
  # grid than the format's would fail this.
  u = fmt.epsilon / 2
  assert (err[normal] / np.abs(x[normal])).max() > 0.95 * u / (1 + u)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_finite_values_and_keeps_non_finite(dtype):
  fmt = FMT[dtype]
  x = jnp.array([fmt.max * 3, -fmt.max * 1e6, 1e38, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
  q = np.asarray(fp8.quantize(x, 0.5, dtype), np.float64)
  np.testing.assert_array_equal(q[:3], [fmt.max, -fmt.max, fmt.max])
  if dtype == E4M3:  # no inf in e4m3fn: non-finite becomes NaN
    assert np.isnan(q[3:]).all()
  else:
    np.testing.assert_array_equal(q[3:5], [np.inf, -np.inf])
    assert np.isnan(q[5])


def test_quantize_accepts_16_bit_inputs_and_rejects_non_fp8_targets():
  x = jnp.array([1.0, -3.0, 0.3], jnp.bfloat16)
  q = fp8.quantize(x, 0.25, E4M3)
  np.testing.assert_array_equal(np.asarray(q, np.float32), [4.0, -12.0, 1.25])
  assert fp8.quantize_dequantize(x, 0.25, E4M3).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="got float16"):
    fp8.quantize(x, 1.0, jnp.float16)
  with pytest.raises(TypeError, match="int32"):
    fp8.quantize(x, 1.0, jnp.int32)


def test_compute_amax():
  assert float(fp8.compute_amax(jnp.array([-3.0, 2.0], jnp.bfloat16))) == 3.0
  assert float(fp8.compute_amax(jnp.zeros((0, 4)))) == 0.0
  assert np.isnan(fp8.compute_amax(jnp.array([1.0, jnp.nan])))
