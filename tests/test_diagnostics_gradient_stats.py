"""diagnostics.gradient_statistics (jmp_lite/diagnostics/_gradient_stats.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import jmp_lite as jl
from jmp_lite import diagnostics as diag

from .diagnostics_testing import as_float, jit, stats_of

F16 = jnp.float16


def test_hand_worked_statistics():
  grads = {
    "params": {
      "Dense_0": {
        "kernel": jnp.array([0.0, 1e-9, 3e-5, 1.0, 7e4, jnp.nan]),
        "bias": jnp.array([2.0**-30, 2.0**-70]),
      },
      "Dense_1": {"kernel": jnp.full((3,), -0.5)},
    }
  }
  stats = stats_of(grads, format="float16")
  assert list(stats) == ["params/Dense_0", "params/Dense_1"]  # kernel and bias: one layer
  s = stats["params/Dense_0"]
  assert int(s.size) == 8
  # 0 | 1e-9, 2^-30, 2^-70 round to 0 in fp16 | 3e-5 is subnormal | 7e4 > 65504 | NaN
  assert as_float(s.zero_fraction) == 1 / 8
  assert as_float(s.underflow_fraction) == 3 / 8
  assert as_float(s.subnormal_fraction) == 1 / 8
  assert as_float(s.overflow_fraction) == 1 / 8
  assert as_float(s.nonfinite_fraction) == 1 / 8
  assert as_float(s.max_abs) == 7e4  # the largest finite magnitude
  exponents = s.bin_exponents()
  nonzero = np.asarray(s.histogram) > 0
  counts = dict(
    zip(exponents[nonzero].tolist(), np.asarray(s.histogram)[nonzero].tolist(), strict=True)
  )
  # 2^-70 is below the range (open bin, labelled -65); 1e-9 and 2^-30 have exponent -30;
  # 3e-5 -> -16; 1.0 -> 0; 7e4 -> 16 = the top of the default range (open bin).
  assert counts == {-65: 1, -30: 2, -16: 1, 0: 1, 16: 1}
  assert int(s.histogram.sum()) == 6  # zeros and NaN are not binned
  d1 = stats["params/Dense_1"]
  assert as_float(d1.max_abs) == 0.5 and as_float(d1.underflow_fraction) == 0
  assert int(d1.histogram[d1.bin_exponents() == -1][0]) == 3


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_underflow_and_overflow_match_xla_casts(fmt):
  info = jl.format_info(fmt)
  rng = np.random.default_rng(0)
  # Values spread around both ends of the range, plus the exact rounding ties.
  ulp_top = 2.0 ** (np.floor(np.log2(info.max)) - info.mantissa_bits)
  values = np.concatenate(
    [
      info.min_subnormal * rng.uniform(0.01, 2.0, 500),
      np.minimum(info.max * rng.uniform(0.9, 1.2, 500), np.finfo(np.float32).max),
      [info.min_subnormal / 2, info.max + ulp_top / 2, info.max],
    ]
  ).astype(np.float32)
  stats = stats_of({"g": jnp.asarray(values)}, format=fmt)["g"]
  cast = np.asarray(jnp.asarray(values).astype(jnp.dtype(fmt))).astype(np.float32)
  assert as_float(stats.nonfinite_fraction) == 0
  assert round(as_float(stats.overflow_fraction) * values.size) == np.sum(~np.isfinite(cast)) > 0
  # bfloat16's underflow edge (4.6e-41) is a float32 subnormal, which XLA on CPU reads as 0.
  if fmt != "bfloat16":
    assert round(as_float(stats.underflow_fraction) * values.size) == np.sum(cast == 0) > 0


def test_loss_scale_moves_values_into_range():
  grads = {"w": jnp.array([1e-9, 1e-6, 1.0])}
  unscaled = stats_of(grads)["w"]
  assert as_float(unscaled.underflow_fraction) == pytest.approx(1 / 3)
  for scale in (2.0**15, jl.DynamicLossScale(2.0**15), jnp.float32(2.0**15)):
    scaled = diag.gradient_statistics(grads, loss_scale=scale)["w"]
    assert as_float(scaled.underflow_fraction) == 0
    assert as_float(scaled.overflow_fraction) == 0
    assert as_float(scaled.loss_scale) == 2.0**15
  too_high = diag.gradient_statistics(grads, loss_scale=2.0**17)["w"]
  assert as_float(too_high.overflow_fraction) == pytest.approx(1 / 3)  # 1.0 * 2^17 > 65504


def test_grouping_and_leaf_filtering():
  grads = {
    "encoder": {"layer_0": {"w": jnp.ones(2), "b": jnp.ones(1)}, "step": jnp.int32(3)},
    "head": jnp.zeros(4, F16),
    "unused": None,
  }
  assert set(stats_of(grads)) == {"encoder/layer_0", "head"}
  assert set(stats_of(grads, group_by="leaf")) == {
    "encoder/layer_0/w",
    "encoder/layer_0/b",
    "head",
  }
  by_top = stats_of(grads, group_by=1)
  assert set(by_top) == {"encoder", "head"} and int(by_top["encoder"].size) == 3
  custom = stats_of(grads, group_by=lambda name: name.split("/")[0].upper())
  assert set(custom) == {"ENCODER", "HEAD"}
  assert as_float(custom["HEAD"].zero_fraction) == 1.0
  float0 = jax.grad(lambda x, n: x * n, argnums=(0, 1), allow_int=True)(2.0, 3)
  assert list(diag.gradient_statistics(float0, group_by="leaf")) == ["0"]


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"group_by": "module"}, ValueError, "group_by"),
    ({"group_by": 0}, ValueError, "group_by"),
    ({"group_by": lambda n: 3}, TypeError, "string"),
    ({"format": "int8"}, TypeError, "int8"),
    ({"format": "float17"}, ValueError, "float17"),
    ({"loss_scale": "big"}, TypeError, "loss_scale"),
    ({"loss_scale": -1.0}, ValueError, "-1.0"),
    ({"loss_scale": jnp.ones(2)}, ValueError, "scalar"),
    ({"exponent_range": (10, 5)}, ValueError, "exponent_range"),
    ({"exponent_range": (-200, 0)}, ValueError, "-126"),
    ({"exponent_range": 5}, TypeError, "exponent_range"),
  ],
)
def test_statistics_argument_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    diag.gradient_statistics({"w": jnp.ones(2)}, **kwargs)


def test_histogram_can_be_skipped_and_range_set():
  grads = {"w": jnp.array([2.0**-3, 2.0**5])}
  none = diag.gradient_statistics(grads, exponent_range=None)["w"]
  assert none.histogram.shape == (0,)
  narrow = diag.gradient_statistics(grads, exponent_range=(-2, 3))["w"]
  assert narrow.histogram.shape == (7,)
  assert np.asarray(narrow.histogram).tolist() == [1, 0, 0, 0, 0, 0, 1]  # both ends open


def test_statistics_under_shard_map_match_the_whole_array():
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  g = jnp.concatenate([jnp.zeros(4), jnp.full(4, 1e-9), jnp.full(4, 2.0), jnp.full(4, 7e4)])
  full = diag.gradient_statistics({"w": g})["w"]

  def local(shard):
    return diag.gradient_statistics({"w": shard}, axis_name="d")["w"]

  sharded = jit(
    jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec())
  )(g)
  for field in ("zero_fraction", "underflow_fraction", "overflow_fraction", "max_abs"):
    assert as_float(getattr(sharded, field)) == as_float(getattr(full, field)), field
  np.testing.assert_array_equal(sharded.histogram, full.histogram)
