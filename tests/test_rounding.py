"""Stochastic rounding and the exact fp32 split, against NumPy and ml_dtypes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_lite as jl
from jmp_lite import _rounding

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=30)
@given(st.lists(finite_f32, min_size=16, max_size=16))
def test_split_rebuilds_every_fp32_bit_and_its_high_half_is_the_nearest_bf16(values):
  x = np.asarray(values, np.float32)
  high, low = _rounding.split_float32(x)
  assert high.dtype == jnp.bfloat16 and low.dtype == jnp.int16
  rebuilt = np.asarray(_rounding.join_float32(high, low))
  np.testing.assert_array_equal(rebuilt.view(np.uint32), x.view(np.uint32))  # -0.0 too
  # The high half is ml_dtypes' round-to-nearest, but for ties, which go away from zero.
  nearest = x.astype(ml_dtypes.bfloat16)
  tie = (x.view(np.uint32) & 0xFFFF) == 0x8000
  away = np.where(tie, np.nextafter(nearest, np.copysign(np.inf, x).astype(nearest.dtype)), nearest)
  np.testing.assert_array_equal(np.asarray(high).view(np.uint16), away.view(np.uint16))


def test_split_edge_values():
  x = np.array(
    [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4028235e38, 1.0 + 2**-8, -(1.0 + 2**-8)],
    np.float32,
  )
  high, low = _rounding.split_float32(x)
  np.testing.assert_array_equal(
    np.asarray(_rounding.join_float32(high, low)).view(np.uint32), x.view(np.uint32)
  )
  # Ties (1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7) go away from zero.
  assert high[-2:].tolist() == [1.0078125, -1.0078125]
  # The largest fp32 value rounds to bf16's inf and is still rebuilt exactly.
  assert high[6] == jnp.inf and int(low[6]) == -1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_round_picks_a_neighbour_with_the_right_probability(dtype):
  # A quarter of the way from 1 to the next value, and three quarters below -2.
  one_up = float(jnp.nextafter(jnp.asarray(1.0, dtype), jnp.asarray(2.0, dtype)))
  x = jnp.asarray([1 + 0.25 * (one_up - 1), -2 - 1.5 * (one_up - 1)], jnp.float32)
  n = 40_000
  y = jax.vmap(lambda k: jl.stochastic_round(x, dtype, k))(jax.random.split(jax.random.key(0), n))
  assert y.dtype == dtype
  ups = np.asarray(y[:, 0] == one_up).mean()
  assert set(np.asarray(y[:, 0], np.float32).tolist()) == {1.0, one_up}
  down = -2 - 2 * (one_up - 1)  # the binade above 2 has twice the spacing
  assert set(np.asarray(y[:, 1], np.float32).tolist()) == {-2.0, down}
  far = np.asarray(y[:, 1] == down).mean()
  # Binomial standard deviations: sqrt(p (1 - p) / n) = 0.0022; four of them.
  assert abs(ups - 0.25) < 0.009 and abs(far - 0.75) < 0.009


@settings(max_examples=20)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=8, max_size=8), st.integers(0, 2**31))
def test_stochastic_round_is_unbiased_and_representable_values_stay(values, seed):
  x = jnp.asarray(values, jnp.float32)
  keys = jax.random.split(jax.random.key(seed), 4096)
  y = jax.vmap(lambda k: jl.stochastic_round(x, jnp.bfloat16, k))(keys).astype(jnp.float32)
  nearest = x.astype(jnp.bfloat16)
  lower = jnp.where(nearest.astype(jnp.float32) > x, jnp.nextafter(nearest, -jnp.inf), nearest)
  upper = jnp.where(nearest.astype(jnp.float32) < x, jnp.nextafter(nearest, jnp.inf), nearest)
  lower, upper = lower.astype(jnp.float32), upper.astype(jnp.float32)
  assert bool(jnp.all((y == lower) | (y == upper)))
  gap = upper - lower
  p = jnp.where(gap > 0, (x - lower) / jnp.where(gap > 0, gap, 1), 0)
  # One shape, one compilation. The mean of 4096 draws is within six standard deviations of x.
  tolerance = 6 * gap * jnp.sqrt(p * (1 - p) / 4096) + 1e-30
  assert bool(jnp.all(jnp.abs(y.mean(0) - x) <= tolerance))
  exact = nearest.astype(jnp.float32) == x
  assert bool(jnp.all(jnp.where(exact, y == x, True)))


def test_stochastic_round_from_fp16_to_fp8_picks_a_neighbour_with_the_right_probability():
  # From fp16 the noise is still 23 bits (fp16 itself cannot hold them): a quarter of the way
  # from 1 to e5m2's next value, 1.25, rounds up a quarter of the time.
  x = jnp.full((40_000,), 1.0625, jnp.float16)
  y = jl.stochastic_round(x, jnp.float8_e5m2, jax.random.key(0)).astype(jnp.float32)
  assert set(np.unique(np.asarray(y)).tolist()) == {1.0, 1.25}
  assert abs(float(jnp.mean(y == 1.25)) - 0.25) < 0.009


def test_stochastic_round_keeps_special_values_and_never_overflows_by_noise():
  x = jnp.asarray([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 65504.0, 65519.0, 7e4], jnp.float32)
  for seed in range(20):
    y = jl.stochastic_round(x, jnp.float16, jax.random.key(seed))
    assert (
      np.asarray(y).view(np.uint16).tolist()[:5]
      == np.asarray(x[:5].astype(jnp.float16)).view(np.uint16).tolist()
    )
    assert y[5] == 65504 and y[6] == 65504 and y[7] == jnp.inf  # as round-to-nearest does


def test_stochastic_round_is_a_function_of_the_key():
  x = jax.random.normal(jax.random.key(1), (256,))
  a = jl.stochastic_round(x, jnp.bfloat16, jax.random.key(7))
  b = jl.stochastic_round(x, jnp.bfloat16, jax.random.key(7))
  c = jl.stochastic_round(x, jnp.bfloat16, jax.random.key(8))
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert bool(jnp.any(a != c))


def test_stochastic_round_rejects_bad_input():
  key = jax.random.key(0)
  with pytest.raises(TypeError, match="int32"):
    jl.stochastic_round(jnp.ones(3, jnp.int32), jnp.bfloat16, key)
  with pytest.raises(ValueError, match="narrower than x's bfloat16, got float32"):
    jl.stochastic_round(jnp.ones(3, jnp.bfloat16), jnp.float32, key)
  with pytest.raises(ValueError, match="narrower"):
    jl.stochastic_round(jnp.ones(3, jnp.float16), jnp.bfloat16, key)


def test_counter_hash_bits_are_uniform_and_independent_of_the_layout():
  seed = jax.random.bits(jax.random.key(3), (), jnp.uint32)
  bits = np.asarray(_rounding._counter_hash(seed, (256, 256)))
  # Built per axis: the same bits as the flat array's, so a sharded array draws what a whole one
  # does.
  np.testing.assert_array_equal(bits.ravel(), np.asarray(_rounding._counter_hash(seed, (65536,))))
  for top in (bits >> 28, (bits >> 16) & 0xF):  # the bits stochastic rounding uses
    counts = np.bincount(top.ravel(), minlength=16)
    assert np.all(np.abs(counts - 4096) < 5 * np.sqrt(4096 * 15 / 16)), counts
  assert len(np.unique(bits)) == bits.size  # one value per index: a bijection of the index
