"""Row-wise scaling (jmp_lite/fp8/_rowwise.py): power-of-two scales per row, the matmul and
its gradients within the format's bounds, the GEMM's output dtype and its rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import fp8
from jmp_lite.fp8._rowwise import _rowwise_product, gemm_dtype, row_scales

from .fp8_testing import E4M3, E5M2, MATMUL, dot_general_avals, extreme_rows, quantization_error


def np_row_scales(x, dtype):
  """2^ceil(log2(amax / fp8_max)) per row (the last axis), 1 for an all-zero row."""
  amax = np.abs(np.asarray(x, np.float64)).max(axis=-1, keepdims=True)
  top = jl.FORMATS[np.dtype(dtype).name].max
  with np.errstate(divide="ignore"):
    return np.where(amax > 0, 2.0 ** np.ceil(np.log2(amax / top)), 1.0)


def test_row_scales_are_powers_of_two_rounded_up_per_row():
  x = jnp.array(
    [[448.0, -3.0], [1.0, 0.5], [0.0, 0.0], [-3e-3, 1e-3], [449.0, 0.0], [1.0, jnp.inf]]
  )
  got = np.asarray(row_scales(x, E4M3))[:, 0]
  # 448 fits at 1; 1/448 rounds up to 2^-8; zeros and inf rows keep 1; 449 needs 2.
  np.testing.assert_array_equal(got, [1.0, 2.0**-8, 1.0, 2.0**-17, 2.0, 1.0])
  np.testing.assert_array_equal(got[:5], np_row_scales(x[:5], E4M3)[:, 0])
  assert float(row_scales(jnp.array([[57344.0]]), E5M2)[0, 0]) == 1.0


def test_rowwise_is_exact_where_a_per_tensor_scale_loses_the_small_rows():
  """Rows of small integers times very different powers of two: one scale per row keeps each
  exact (x's rows and w's columns), so the product is exact; one scale per tensor flushes the
  small rows (2^-20 below the outlier row)."""
  rng = np.random.default_rng(6)
  ints = lambda shape: rng.integers(-8, 9, shape).astype(np.float32)
  x = ints((4, 16)) * (2.0 ** np.array([12, 0, -8, -20], np.float32))[:, None]
  w = ints((16, 3)) * (2.0 ** np.array([0, -6, 9], np.float32))[None, :]
  x, w = jnp.asarray(x), jnp.asarray(w)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  recipes = (fp8.RowwiseScaling(), fp8.CurrentScaling())
  both = jax.jit(lambda x, w: [fp8.dot_general(x, w, MATMUL, config=r) for r in recipes])
  rowwise, per_tensor = (np.asarray(v) for v in both(x, w))
  np.testing.assert_array_equal(rowwise, want)
  assert np.all(per_tensor[3] == 0) and np.any(want[3] != 0)


@pytest.mark.parametrize("weight_grad", ["fp8", "compute_dtype"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rowwise_matmul_and_gradients_within_format_bounds(weight_grad, seed):
  """Against float64: each output and gradient element within the bound of E4M3 rounding of
  both operands of its product, with the per-row scales; the weight gradient in the compute
  dtype (fp32 here) is the fp32 product."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((8, 32)) * np.exp(rng.uniform(-6, 6, (8, 1)))  # rows of every range
  w = rng.standard_normal((32, 6)) * 0.1
  g = rng.standard_normal((8, 6)) * np.exp(rng.uniform(-12, 0, (8, 1))) * 1e-5
  recipe = fp8.RowwiseScaling(weight_grad=weight_grad)

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  y, dx, dw = (np.asarray(v, np.float64) for v in run(*(jnp.float32(v) for v in (x, w, g))))
  x, w, g = (np.asarray(np.float32(v), np.float64) for v in (x, w, g))

  def bound(a, b):  # a [M, K] @ b [K, N], a's rows and b's columns scaled
    ea = quantization_error(a, np_row_scales(a, E4M3), E4M3)
    eb = quantization_error(b, np_row_scales(b.T, E4M3).T, E4M3)
    return ea @ (np.abs(b) + eb) + np.abs(a) @ eb

  for got, a, b in ((y, x, w), (dx, g, w.T)) + (((dw, x.T, g),) if weight_grad == "fp8" else ()):
    want = a @ b
    assert np.all(np.abs(got - want) <= bound(a, b) + 1e-6 * np.abs(want).max())
    assert np.linalg.norm(got - want) <= 0.1 * np.linalg.norm(want)
  if weight_grad == "compute_dtype":
    np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-6 * np.abs(x.T @ g).max())


def fp32_rowwise_product(a, b, a_dtype, b_dtype, out_dtype):
  """The row-wise product with the GEMM's fp32 sum scaled before any rounding."""
  s_a, s_b = row_scales(a, a_dtype), row_scales(b, b_dtype)
  q_a, q_b = fp8.quantize(a, s_a, a_dtype), fp8.quantize(b, s_b, b_dtype)
  dims = (((2,), (2,)), ((0,), (0,)))
  out = lax.dot_general(q_a, q_b, dims, lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return (out * (s_a * jnp.swapaxes(s_b, 1, 2))).astype(out_dtype)


def test_rowwise_gemm_writes_the_output_dtype_when_it_has_fp32_range():
  """bf16 operands: the forward GEMM and both fp8 gradient GEMMs write bf16 (half the bytes of
  fp32), the scales applied after; float16 keeps an fp32 GEMM result (its sum may pass 65504
  where the scaled result does not)."""
  assert gemm_dtype(jnp.bfloat16) == jnp.bfloat16 and gemm_dtype(jnp.float32) == jnp.float32
  assert gemm_dtype(jnp.float16) == jnp.float32
  for dtype, want in ((jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float32)):
    x, w, g = jnp.ones((16, 64), dtype), jnp.ones((64, 8), dtype), jnp.ones((16, 8), dtype)
    dots = dot_general_avals(fp8.RowwiseScaling(), x, w, g)
    assert len(dots) == 3
    for operands, out in dots:
      assert [o.dtype for o in operands] == [E4M3, E4M3] and out.dtype == want


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
def test_rowwise_rounding_before_the_power_of_two_scales_changes_no_bit(out_dtype, a_dtype):
  """Against the GEMM's fp32 sum scaled and then rounded: bit-identical, on rows spanning
  2^-40..2^40 and on chosen rows: one at 2^100 against columns at 2^27 (products past bf16's
  and fp32's largest value: inf in both where they overflow), one at 2^-60."""
  rng = np.random.default_rng(11)
  a = extreme_rows(rng, (2, 12, 200), -40, 40)
  b = extreme_rows(rng, (2, 10, 200), -40, 40)
  unit = lambda v: v / np.abs(v).max(-1, keepdims=True)  # rows of amax 1
  a[0, 0] = unit(rng.standard_normal(200)) * 2.0**100
  b[0, :3] = unit(rng.standard_normal((3, 200))) * 2.0**27
  a[1, 0] = unit(rng.standard_normal(200)) * 2.0**-60
  a, b = jnp.asarray(a).astype(out_dtype), jnp.asarray(b).astype(out_dtype)
  highest = lax.Precision.HIGHEST
  got = jax.jit(lambda a, b: _rowwise_product(a, b, a_dtype, E4M3, out_dtype, highest))(a, b)
  want = jax.jit(lambda a, b: fp32_rowwise_product(a, b, a_dtype, E4M3, out_dtype))(a, b)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_array_equal(got, want)
  if out_dtype != jnp.float16:
    assert np.isinf(got[0, 0, :3]).any() and np.isfinite(got[1]).all()
