import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_lite as jl
from jmp_lite import _dtypes as dtypes


def test_table_has_the_formats_that_matter():
  assert set(jl.FORMATS) == {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


@pytest.mark.parametrize(
  "name, exp, man, max_, min_normal, min_subnormal, eps",
  [
    ("float32", 8, 23, float(np.finfo(np.float32).max), 2.0**-126, 2.0**-149, 2.0**-23),
    ("float16", 5, 10, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
    (
      "bfloat16",
      8,
      7,
      float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
      2.0**-126,
      2.0**-133,
      2.0**-7,
    ),
    ("float8_e4m3fn", 4, 3, 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
    ("float8_e5m2", 5, 2, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
  ],
)
def test_format_facts(name, exp, man, max_, min_normal, min_subnormal, eps):
  info = jl.FORMATS[name]
  assert (info.exponent_bits, info.mantissa_bits) == (exp, man)
  assert (info.max, info.min_normal, info.min_subnormal, info.epsilon) == (
    max_,
    min_normal,
    min_subnormal,
    eps,
  )
  assert info.bits == 1 + exp + man
  # The facts describe the dtype's real behaviour, not just the table: each value is exactly
  # representable, and halfway to the next value rounds to even.
  dt = info.dtype
  as_dt = lambda x: float(np.asarray(x, dt))
  assert as_dt(info.min_subnormal) == info.min_subnormal
  assert as_dt(info.min_subnormal / 2) == 0.0  # ties-to-even rounds to 0
  assert as_dt(info.min_normal) == info.min_normal
  assert as_dt(info.min_normal - info.min_subnormal) == info.min_normal - info.min_subnormal
  assert as_dt(info.max) == info.max
  assert as_dt(1 + info.epsilon) == 1 + info.epsilon
  assert as_dt(1 + info.epsilon / 2) == 1.0  # the tie goes to 1.0, whose last bit is even


@pytest.mark.parametrize(
  "name, expected",
  [
    ("bf16", jnp.bfloat16),
    ("bfloat16", jnp.bfloat16),
    ("f16", jnp.float16),
    ("float16", jnp.float16),
    ("f32", jnp.float32),
    ("float32", jnp.float32),
    ("full", jnp.float32),
    ("f64", jnp.float64),
    ("float64", jnp.float64),
    (" BF16 ", jnp.bfloat16),
    ("float8_e4m3fn", jnp.float8_e4m3fn),
    ("e5m2", jnp.float8_e5m2),
    (np.dtype("float16"), jnp.float16),
    (jnp.bfloat16, jnp.bfloat16),
    (np.float32, jnp.float32),
  ],
)
def test_parse_dtype(name, expected):
  assert jl.parse_dtype(name) == np.dtype(expected)


def test_parse_half_is_the_platform_half():
  assert jl.parse_dtype("half") == jl.half_dtype()


@pytest.mark.parametrize("bad", ["float", "f", "", "bfloat", "float128x"])
def test_parse_dtype_unknown_name(bad):
  with pytest.raises(ValueError, match="accepted names"):
    jl.parse_dtype(bad)


@pytest.mark.parametrize("bad", ["int8", "int32", "bool", np.int32, np.dtype("complex64"), None])
def test_parse_dtype_rejects_non_floating(bad):
  with pytest.raises(TypeError):
    jl.parse_dtype(bad)


def test_every_accepted_name_round_trips_through_dtype_name():
  for name in dtypes.ACCEPTED_NAMES:
    dt = jl.parse_dtype(name)
    assert jl.parse_dtype(dtypes.dtype_name(dt)) == dt


@pytest.mark.parametrize(
  "platform, cc, expected",
  [
    ("tpu", None, jnp.bfloat16),
    ("cpu", None, jnp.bfloat16),
    ("gpu", "9.0", jnp.bfloat16),
    ("cuda", "8.0", jnp.bfloat16),
    ("gpu", "8.6", jnp.bfloat16),
    ("gpu", "7.5", jnp.float16),
    ("gpu", "7.0", jnp.float16),
    ("cuda", "6.1", jnp.float16),
    ("gpu", "10.0", jnp.bfloat16),
    ("rocm", "gfx90a", jnp.bfloat16),
    ("gpu", "gfx90a", jnp.bfloat16),
  ],
)
def test_half_dtype_for_platform(platform, cc, expected):
  assert dtypes.half_dtype_for(platform, cc) is expected  # the JAX scalar type, as jmp's


def test_half_dtype_reads_the_device():
  class FakeV100:
    platform = "gpu"
    compute_capability = "7.0"

  class FakeH100:
    platform = "gpu"
    compute_capability = "9.0"

  assert jl.half_dtype(FakeV100()) is jnp.float16
  assert jl.half_dtype(FakeH100()) is jnp.bfloat16
  assert jl.half_dtype() is jnp.bfloat16  # tests run on CPU


def test_half_dtype_is_callable_like_jmps():
  # jmp's README: jmp.DynamicLossScale(jmp.half_dtype()(2 ** 15)).
  scale = jl.half_dtype()(2**15)
  assert scale.dtype == jnp.bfloat16 and float(scale) == 2.0**15
  assert jnp.dtype(jl.half_dtype()) == np.dtype(jnp.bfloat16)
  assert jl.parse_dtype("half") == np.dtype(jnp.bfloat16)
  assert isinstance(jl.parse_dtype("half"), np.dtype)


@pytest.mark.parametrize(
  "value, expected",
  [
    ("f32", jnp.float32),
    ("float16", jnp.float16),
    (" BF16 ", jnp.bfloat16),
    ("full", jnp.float32),
    ("f64", jnp.float64),
    ("float8_e4m3fn", jnp.float8_e4m3fn),
    ("e5m2", jnp.float8_e5m2),
    (np.dtype("float16"), jnp.float16),
    (np.float32, jnp.float32),
    (ml_dtypes.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16),
  ],
)
def test_scalar_type(value, expected):
  scalar = jl.scalar_type(value)
  assert scalar is expected
  assert scalar == np.dtype(expected) and np.dtype(scalar) == np.dtype(expected)
  assert hash(scalar) == hash(np.dtype(expected).type)  # finds dict keys np.float16 and jnp.float16


def test_scalar_type_without_a_jax_name_is_numpys():
  # No jax.numpy alias for long double: NumPy's scalar type, callable and hashable too.
  if np.dtype(np.longdouble) == np.dtype(np.float64):
    pytest.skip("long double is float64 on this platform")
  assert jl.scalar_type(np.longdouble) is np.longdouble


def test_scalar_type_rejects_what_parse_dtype_rejects():
  with pytest.raises(TypeError, match="int32"):
    jl.scalar_type(jnp.int32)
  with pytest.raises(ValueError, match="Unknown dtype name"):
    jl.scalar_type("f33")


def test_half_dtype_for_unknown_platform():
  with pytest.raises(ValueError, match="metal"):
    dtypes.half_dtype_for("metal")


def test_format_info_accepts_names():
  assert jl.format_info("f16") == jl.FORMATS["float16"]
  assert jl.format_info(jnp.bfloat16).max == (2 - 2.0**-7) * 2.0**127
