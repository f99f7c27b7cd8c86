"""fp8.Fp8Placement and fp8.MatmulRoofline: which matmuls run in fp8, by path, class and size."""

import math

import jax.numpy as jnp
import pytest

from jmp_lite import fp8
from jmp_lite.fp8._placement import matmul_dims, positions

H200 = {"f16": 989e12, "f8": 1979e12, "w": 4.8e12}


def _by_hand(m, k, n, fp8_step):
  """The documented estimate, written out: three GEMMs, then the quantization traffic."""
  mk, kn, mn = m * k, k * n, m * n
  if fp8_step:
    flops = 2 * m * k * n / H200["f8"]
    gemm = lambda a, b, out: max(flops, (a + b + 2 * out) / H200["w"])
    quantize = 7 * (mk + kn + mn) / H200["w"]
  else:
    flops = 2 * m * k * n / H200["f16"]
    gemm = lambda a, b, out: max(flops, (2 * a + 2 * b + 2 * out) / H200["w"])
    quantize = 0.0
  return gemm(mk, kn, mn) + gemm(mn, kn, mk) + gemm(mk, mn, kn) + quantize


@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (1, 8192, 8192), (8192, 1024, 1024)])
def test_roofline_is_the_documented_estimate(shape):
  rule = fp8.MatmulRoofline()
  for fp8_step in (False, True):
    assert rule.step_time(*shape, fp8=fp8_step) == pytest.approx(
      _by_hand(*shape, fp8_step), rel=1e-12
    )
  # Compute-bound and square: each GEMM at its peak, plus 7 bytes per element of 3 operands.
  d = 4096
  assert rule.step_time(d, d, d, fp8=True) == pytest.approx(
    3 * 2 * d**3 / 1979e12 + 7 * 3 * d * d / 4.8e12, rel=1e-12
  )


def test_roofline_says_where_fp8_pays_on_an_h200():
  rule = fp8.MatmulRoofline()
  # torchao's two published points: fp8 slower at 1024, 2048, 1024; faster at 4096, 8192, 16384.
  assert rule.speedup(1024, 2048, 1024) == pytest.approx(0.920, abs=1e-3)
  assert rule.speedup(4096, 8192, 16384) == pytest.approx(1.660, abs=1e-3)
  # Square matmuls pay from 1442 (the docs' figure): the boundary on both sides.
  assert not rule.should_run(1441, 1441, 1441)
  assert rule.should_run(1442, 1442, 1442)
  # Decode-sized M never pays: quantizing the weight costs more than the GEMM saves.
  assert not rule.should_run(1, 16384, 16384)
  # H100 bandwidth: the same shapes need more work to pay.
  h100 = fp8.MatmulRoofline(memory_bandwidth=3.35e12)
  assert h100.speedup(1442, 1442, 1442) < 1 < rule.speedup(1442, 1442, 1442)


def test_placement_reasons_in_their_order():
  p = fp8.Fp8Placement(include=("blocks", int), exclude=r"/down$", shape_rule=None)
  assert p.include == ("blocks", int) and p.exclude == ("/down$",)
  assert p.reason("embed", (object,), None) == "matched by no include pattern"
  assert p.reason("blocks/0/down", (object,), None) == "excluded by '/down$'"
  assert p.reason("blocks/0/up", (object,), "first") == "the first matmul layer (keep_first_last)"
  assert p.reason("blocks/0/up", (object,), None) is None
  # A class pattern matches the layer or a module it is called inside (subclasses too).
  assert p.reason("head", (object, bool), None) is None  # bool is an int
  classes = fp8.Fp8Placement(exclude=(int,), keep_first_last=False)
  assert classes.reason("x", (str, bool), "last") == "excluded by int"
  assert fp8.Fp8Placement(keep_first_last=False).reason("x", (), "last") is None


def test_shape_rule_boundary_and_off():
  p = fp8.Fp8Placement()
  assert p.shape_reason(1441, 1441, 1441) == (
    "M, K, N = 1441, 1441, 1441: too small to pay (shape_rule)"
  )
  assert p.shape_reason(1442, 1442, 1442) is None
  assert fp8.Fp8Placement(shape_rule=None).shape_reason(1, 1, 1) is None
  assert fp8.ALL_LAYERS == fp8.Fp8Placement(keep_first_last=False, shape_rule=None)

  class AtLeast:  # any object with should_run(m, k, n) is a shape rule
    def should_run(self, m, k, n):
      return m * k * n >= 64

  custom = fp8.Fp8Placement(shape_rule=AtLeast())
  assert isinstance(AtLeast(), fp8.ShapeRule)
  assert custom.shape_reason(4, 4, 4) is None
  assert custom.shape_reason(4, 4, 3) == "M, K, N = 4, 4, 3: too small to pay (shape_rule)"


def test_placements_are_hashable_and_static():
  a = fp8.Fp8Placement(exclude=["head"])  # a list becomes a tuple: hashable, jit-static
  assert a == fp8.Fp8Placement(exclude=("head",))
  assert hash(a) == hash(fp8.Fp8Placement(exclude="head"))


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"include": 3}, TypeError, "include must be .* got 3 of type int"),
    ({"exclude": ["ok", 2.5]}, TypeError, "exclude takes .* got 2.5 of type float"),
    ({"exclude": "blocks/("}, ValueError, r"exclude pattern 'blocks/\(' is not a regular"),
    ({"keep_first_last": "yes"}, TypeError, "keep_first_last must be a bool, got 'yes'"),
    ({"shape_rule": 1024}, TypeError, "shape_rule must be None or have a should_run.* 1024"),
  ],
)
def test_bad_placement_arguments_name_the_value(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.Fp8Placement(**kwargs)


@pytest.mark.parametrize(
  "field, value, error",
  [
    ("memory_bandwidth", 0.0, ValueError),
    ("peak_flops_fp8", math.inf, ValueError),
    ("quantize_bytes", "7", TypeError),
  ],
)
def test_bad_roofline_numbers_name_the_field(field, value, error):
  with pytest.raises(error, match=field):
    fp8.MatmulRoofline(**{field: value})


def test_first_and_last_layers_by_call_order_and_shared_inputs():
  x, h, y = jnp.ones(2), jnp.ones(3), jnp.ones(4)
  # q, k, v read the block's input: all three are first; two heads read the trunk: both last.
  calls = [("q", x), ("k", x), ("v", x), ("mlp", h), ("policy", y), ("value", y)]
  assert positions(calls) == {
    "q": "first",
    "k": "first",
    "v": "first",
    "policy": "last",
    "value": "last",
  }
  assert positions([("only", x)]) == {"only": "first"}
  assert positions([]) == {}


def test_matmul_dims_fold_batch_axes_into_m():
  assert matmul_dims((8, 16, 32), (32, 64), (((2,), (0,)), ((), ()))) == (128, 32, 64)
  assert matmul_dims((4, 8, 32), (4, 32, 64), (((2,), (1,)), ((0,), (0,)))) == (32, 32, 64)
