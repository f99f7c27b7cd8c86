"""MXFP8 (jmp_lite/fp8/_mx.py): E8M0 scales per 32 elements, the emulated matmul against the
format, bf16 dequantized operands, and the native path's support report."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import fp8
from jmp_lite.fp8._mx import e8m0_scales, mx_product, mx_quantize_dequantize

from .fp8_testing import (
  E4M3,
  E5M2,
  F32,
  MATMUL,
  assert_bits_equal,
  bf16_operands,
  dot_general_avals,
  extreme_rows,
  value_and_vjp,
  vjp_residuals,
)


def test_e8m0_scales_round_up_per_32_elements():
  """One power of two per 32 elements, rounded up so the block's amax fits: 448 -> 1,
  449 -> 2 (rounding down, as the OCP conversion does, would saturate 449), 1 -> 2^-8,
  an all-zero block -> 1, tiny -> clamped at 2^-126."""
  amaxes = [448.0, 449.0, 1.0, 0.0, 2.0**-120, 57344.0]
  x = np.zeros((len(amaxes), 64), np.float32)
  x[:, 5] = amaxes  # first block of each row
  x[:, 40] = 3.0  # second block: 3 -> 2^-7 (3/448 = 0.0067 <= 2^-7)
  got = np.asarray(e8m0_scales(jnp.asarray(x), E4M3))
  assert got.shape == (6, 2)
  np.testing.assert_array_equal(got[:, 0], [1.0, 2.0, 2.0**-8, 1.0, 2.0**-126, 128.0])
  np.testing.assert_array_equal(got[:, 1], [2.0**-7] * 6)


def np_mx_matmul(a, b):
  """a [M, K] @ b [K, N] through MXFP8 (blocks of 32 along K), in float64."""

  def qdq(v):  # blocks along the last axis
    v = np.asarray(v, np.float32)
    k = v.shape[-1]
    v = np.pad(v, ((0, 0), (0, -k % 32)))
    blocks = np.abs(v).reshape(v.shape[0], -1, 32).max(-1)
    with np.errstate(divide="ignore"):
      scale = np.where(blocks > 0, 2.0 ** np.ceil(np.log2(blocks / 448.0)), 1.0)
    scale = np.repeat(scale.astype(np.float32), 32, axis=1)
    return ((v / scale).astype(E4M3).astype(np.float64) * scale)[:, :k]

  return qdq(a) @ qdq(b.T).T


@pytest.mark.parametrize("k", [64, 70])
def test_mxfp8_emulated_matmul_and_gradients_match_the_format(k):
  """The emulated path (quantize in 32-element blocks, dequantize, fp32 matmul) against a
  float64 emulation, for the output and both gradients (each blocked along its own
  contraction; K = 70 is padded); and within 10% of float64 in norm."""
  rng = np.random.default_rng(k)
  x = np.float32(rng.standard_normal((6, k)) * np.exp(rng.uniform(-5, 5, (1, k))))
  w = np.float32(rng.standard_normal((k, 40)))
  g = np.float32(rng.standard_normal((6, 40)) * 1e-4)

  @jax.jit
  def run(x, w, g):
    f = lambda x, w: fp8.dot_general(x, w, MATMUL, config=fp8.Mxfp8Scaling())
    y, vjp = jax.vjp(f, x, w)
    return y, *vjp(g)

  y, dx, dw = (np.asarray(v, np.float64) for v in run(x, w, g))
  for got, want, exact in (
    (y, np_mx_matmul(x, w), x.astype(np.float64) @ w),
    (dx, np_mx_matmul(g, w.T), g.astype(np.float64) @ w.T),
    (dw, np_mx_matmul(x.T, g), x.T.astype(np.float64) @ g),
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert np.linalg.norm(got - exact) <= 0.1 * np.linalg.norm(exact)


def fp32_mx_product(a, b, a_dtype, b_dtype):
  """The emulated MXFP8 product with the operands dequantized to fp32 and an fp32 matmul."""

  def qdq(x, dtype):
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % 32)])
    scale = jnp.repeat(e8m0_scales(x, dtype), 32, axis=-1)
    return fp8.quantize(x, scale, dtype).astype(F32) * scale

  dims = (((2,), (2,)), ((0,), (0,)))
  a, b = qdq(a, a_dtype), qdq(b, b_dtype)
  return lax.dot_general(a, b, dims, lax.Precision.HIGHEST, preferred_element_type=F32)


def fp32_dequantized(x, dtype):
  scale = jnp.repeat(e8m0_scales(x, dtype), 32, axis=-1)
  return fp8.quantize(x, scale, dtype).astype(F32) * scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_mxfp8_dequantizes_to_bf16_exactly(dtype):
  """q * s in bf16 is the fp32 value, bit for bit: bf16 inputs with block amaxes from 2^-133
  (the smallest bf16 subnormal; the scale is clamped at 2^-126) to 2^127, and fp32 inputs
  whose blocks' scales are at least 2^-124 (E4M3) / 2^-117 (E5M2). (The exception, an fp32
  input off bf16's subnormal grid in a block scaled by 2^-126, such as 2^-135 next to 2^-118,
  is 2^-135 in fp32 and 0 in bf16; XLA:CPU flushes that fp32 subnormal to 0 as well.)"""
  rng = np.random.default_rng(13)
  exps = np.arange(-133, 128, 2)
  x = rng.standard_normal((len(exps), 64)) * (2.0**exps)[:, None]
  x[:, 0] = 2.0**exps  # the block's amax is at least 2^e: no row is all subnormal noise
  bf16 = jnp.asarray(np.float32(x)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(
    np.asarray(mx_quantize_dequantize(bf16, dtype), np.float32), fp32_dequantized(bf16, dtype)
  )
  lowest = -124 if dtype == E4M3 else -117
  top = float(jl.FORMATS[dtype.name].max)
  fp32 = np.float32(x[exps >= lowest + 9]) if dtype == E4M3 else np.float32(x[exps >= lowest + 16])
  scales = np.asarray(e8m0_scales(jnp.asarray(fp32), dtype))
  assert scales.min() >= 2.0**lowest and np.abs(fp32).max() <= top * 2.0**127
  np.testing.assert_array_equal(
    np.asarray(mx_quantize_dequantize(jnp.asarray(fp32), dtype), np.float32),
    fp32_dequantized(jnp.asarray(fp32), dtype),
  )


@pytest.mark.parametrize("operands", [jnp.bfloat16, jnp.float32])
def test_mxfp8_bf16_operands_give_the_fp32_matmul(operands):
  """mx_product (bf16 dequantized operands, fp32 sums) against fp32 dequantized operands and
  an fp32 matmul: the same operand values and exact products, summed in fp32 in an order the
  backend picks (XLA:CPU's bf16 and fp32 dots differ in the last bits of a few sums), E4M3 and
  E5M2, rows 2^-40..2^40 apart, K = 200 padded."""
  rng = np.random.default_rng(14)
  a = jnp.asarray(extreme_rows(rng, (2, 12, 200), -40, 40)).astype(operands)
  b = jnp.asarray(extreme_rows(rng, (2, 10, 200), -40, 40)).astype(operands)
  for dtypes in ((E4M3, E4M3), (E5M2, E4M3)):
    got = jax.jit(lambda a, b, d=dtypes: mx_product(a, b, *d, F32))(a, b)
    want = np.asarray(jax.jit(lambda a, b, d=dtypes: fp32_mx_product(a, b, *d))(a, b))
    # fp32 sums of 224 exact products, reordered: within 224 * 2^-24 of the sum of |terms|.
    terms = np.asarray(jax.jit(lambda a, b, d=dtypes: fp32_mx_product(abs(a), abs(b), *d))(a, b))
    assert np.all(np.abs(np.asarray(got) - want) <= 224 * 2.0**-24 * terms)


def test_mxfp8_emulated_dots_take_bf16_operands():
  """The forward and both gradient dots read bf16 (half the bytes of fp32), sum in fp32."""
  x, w, g = jnp.ones((16, 64), F32), jnp.ones((64, 8), F32), jnp.ones((16, 8), F32)
  dots = dot_general_avals(fp8.Mxfp8Scaling(), x, w, g)
  assert len(dots) == 3
  for operands, out in dots:
    assert [o.dtype for o in operands] == [jnp.bfloat16] * 2 and out.dtype == F32


def test_mxfp8_native_path_reports_whether_this_jax_compiles_it():
  """jax.nn.scaled_dot_general: used where it compiles, and a clear error where it does not
  (JAX 0.10.2 on CPU: no lowering of 'scaled_matmul'); never a silent fallback."""
  supported, reason = fp8.mxfp8_native_support()
  assert reason.startswith(f"jax {jax.__version__} ")
  assert jax.default_backend() in reason
  x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  native = fp8.Mxfp8Scaling(implementation="scaled_dot_general")
  if supported:
    y = fp8.dot_general(x, w, MATMUL, config=native, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(y, np.full((4, 32), 64.0))
  else:
    assert "does not compile it" in reason
    with pytest.raises(NotImplementedError, match="implementation='emulated'"):
      fp8.dot_general(x, w, MATMUL, config=native)
  if jax.default_backend() == "cpu" and jax.__version__ == "0.10.2":
    assert not supported and "scaled_matmul" in reason
  with pytest.raises(ValueError, match="implementation"):
    fp8.Mxfp8Scaling(implementation="cudnn")


def requantizing_mx_vjp(x, w, g):
  """The output and both gradients (fwd E4M3, bwd E5M2) with every product quantizing its
  high-precision operands (the backward's from x and w, requantized), in the canonical form."""
  t = lambda v: jnp.swapaxes(v, 1, 2)
  a, b, g = x[None], w.T[None], g[None]
  product = functools.partial(mx_product, out_dtype=jnp.bfloat16)
  y, da = product(a, b, E4M3, E4M3), product(g, t(b), E5M2, E4M3)
  return y[0], da[0], product(t(g), t(a), E5M2, E4M3)[0].T


@pytest.mark.parametrize("shape", [(40, 70, 50), (64, 32, 96)])
def test_mxfp8_saves_fp8_residuals_and_gives_the_requantized_results(shape):
  """The forward saves x^T and w^T in fp8, blocked along the tokens and along N (the
  gradients' contractions), with E8M0 scales as uint8 exponents, and no high-precision
  operand; the output and both gradients are bit for bit those of products that quantize x
  and w again. M, K, N = 40, 70, 50 are padded."""
  m, k, n = shape
  rng = np.random.default_rng(m)
  x, w, g = bf16_operands(rng, m, k, n)
  pad = lambda v: -(-v // 32) * 32
  recipe = fp8.Mxfp8Scaling(bwd_dtype=E5M2)
  assert vjp_residuals(recipe, x, w) == sorted([
    ("float8_e4m3fn", (1, k, pad(m))), ("uint8", (1, k, pad(m) // 32)),
    ("float8_e4m3fn", (1, k, pad(n))), ("uint8", (1, k, pad(n) // 32)),
  ])  # fmt: skip
  f = lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe)
  y, (dx, dw) = value_and_vjp(f, x, w, g)
  for got, want in zip((y, dx, dw), jax.jit(requantizing_mx_vjp)(x, w, g), strict=True):
    assert_bits_equal(got, want)
