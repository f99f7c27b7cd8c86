"""Block scaling as DeepSeek-V3 trains (jmp_lite/fp8/_block.py): 1 x 128 and 128 x 128 tiles,
fp32 sums every 128 of K, the loops over row tiles and chunks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite.fp8._block as _block_module
from jmp_lite import fp8
from jmp_lite.fp8._block import tile_scales

from .fp8_testing import (
  E4M3,
  F32,
  MATMUL,
  assert_bits_equal,
  bf16_operands,
  dot_general_avals,
  extreme_rows,
  value_and_vjp,
  vjp_residuals,
)


def np_tile_scale(x, rows, cols=128):
  """Per-element fp32 scale of a 2-D array in rows x cols tiles (amax / 448; 1 if zero)."""
  m, k = x.shape
  pm, pk = -m % rows, -k % cols
  padded = np.pad(np.abs(np.asarray(x, np.float32)), ((0, pm), (0, pk)))
  tiles = padded.reshape((m + pm) // rows, rows, (k + pk) // cols, cols).max(axis=(1, 3))
  scale = np.where(tiles > 0, tiles / np.float32(448), np.float32(1)).astype(np.float32)
  return np.repeat(np.repeat(scale, rows, 0), cols, 1)[:m, :k]


def np_block_matmul(a, b, a_rows, b_rows):
  """a [M, K] @ b [K, N] as the recipe computes it, in float64: per-tile E4M3 values, exact
  fp8 products summed per 128-chunk of K, each chunk scaled, the chunks summed."""
  s_a, s_b = np_tile_scale(a, a_rows), np_tile_scale(b.T, b_rows).T
  q = lambda v, s: (np.asarray(v, np.float32) / s).astype(E4M3).astype(np.float64)
  q_a, q_b = q(a, s_a), q(b, s_b)
  out = 0.0
  for c in range(0, a.shape[1], 128):
    chunk = q_a[:, c : c + 128] @ q_b[c : c + 128]  # exact in float64
    out = out + chunk * s_a[:, c : c + 1] * s_b[c : c + 1, :]
  return out


def test_block_tiles_are_1x128_for_activations_and_128x128_for_weights():
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((1, 256, 256)) * np.exp(rng.uniform(-8, 8, (1, 256, 1))))
  x = x.astype(jnp.float32)
  tiles, blocks = tile_scales(x, 1, E4M3), tile_scales(x, 128, E4M3)
  assert tiles.shape == (1, 256, 2) and blocks.shape == (1, 2, 2)
  # amax / 448 in fp32 (XLA may divide by multiplying with 1/448: one ulp).
  ulp = {"rtol": 2.0**-22}
  np.testing.assert_allclose(np.repeat(tiles[0], 128, 1), np_tile_scale(x[0], 1), **ulp)
  np.testing.assert_allclose(
    np.repeat(np.repeat(blocks[0], 128, 0), 128, 1), np_tile_scale(x[0], 128), **ulp
  )
  want = np.abs(np.asarray(x[0, 128:, :128])).max() / np.float32(448)
  np.testing.assert_allclose(float(blocks[0, 1, 0]), want, **ulp)
  zeros = tile_scales(jnp.zeros((1, 1, 128)), 1, E4M3)
  assert float(zeros[0, 0, 0]) == 1.0


@pytest.mark.parametrize("k", [128, 200, 384])
def test_block_matmul_is_the_chunked_fp32_sum_of_its_tiles(k):
  """The matmul (and both gradients) against a float64 emulation of the recipe: tiles of
  1 x 128 (x, g) and 128 x 128 (w), E4M3 everywhere, fp8 sums per 128-chunk of K promoted to
  fp32; K = 200 is padded. Agreement to fp32 rounding of the chunk sums."""
  rng = np.random.default_rng(k)
  m, n = 6, 130  # N over one block: two weight blocks along N
  # Chunks of K with very different ranges: a per-row scale would flush the small chunk.
  x = rng.standard_normal((m, k)) * np.where(np.arange(k) < 128, 2.0**8, 2.0**-8)
  w, g = rng.standard_normal((k, n)), rng.standard_normal((m, n)) * 1e-3
  x, w, g = (np.asarray(v, np.float32) for v in (x, w, g))
  recipe = fp8.BlockScaling()

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  y, dx, dw = (np.asarray(v, np.float64) for v in run(x, w, g))
  for got, want in (
    (y, np_block_matmul(x, w, 1, 128)),
    (dx, np_block_matmul(g, w.T, 1, 128)),  # the weight's blocks, transposed
    (dw, np_block_matmul(x.T, g, 1, 1)),  # x^T and g in tiles along the tokens
  ):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
  exact = x.astype(np.float64) @ w
  assert np.linalg.norm(y - exact) <= 0.1 * np.linalg.norm(exact)


def test_block_scales_each_chunk_of_k_where_a_row_scale_flushes():
  """A row 2^22 larger in its first 128 elements of K than after: with the first chunk's
  kernel rows zero, the product is the small chunk's alone; its own 1 x 128 tiles keep it
  (fp8 rounding), one scale per row flushes it to zero."""
  rng = np.random.default_rng(9)
  x = rng.standard_normal((4, 256)) * np.where(np.arange(256) < 128, 2.0**10, 2.0**-12)
  w = rng.standard_normal((256, 8)) * (np.arange(256) >= 128)[:, None]
  x, w = np.float32(x), np.float32(w)
  exact = x.astype(np.float64) @ w
  recipes = (fp8.BlockScaling(), fp8.RowwiseScaling())
  both = jax.jit(lambda x, w: [fp8.dot_general(x, w, MATMUL, config=r) for r in recipes])
  block, rowwise = (np.asarray(v, np.float64) for v in both(x, w))
  assert np.linalg.norm(block - exact) <= 0.1 * np.linalg.norm(exact)
  assert np.all(rowwise == 0)


def test_block_weight_gradient_uses_tiles_along_the_tokens():
  """dW = x^T g: x and g quantized in 1 x 128 tiles of x^T and g^T (128 tokens each)."""
  rng = np.random.default_rng(8)
  x = np.asarray(rng.standard_normal((256, 16)), np.float32)
  x[128:] *= 2.0**-12  # the second 128 tokens are small: their own tiles keep them
  g = np.asarray(rng.standard_normal((256, 4)), np.float32)
  loss = lambda w: jnp.sum(fp8.dot_general(x, w, MATMUL, config=fp8.BlockScaling()) * g)
  dw = jax.jit(jax.grad(loss))(jnp.zeros((16, 4)))
  want = np_block_matmul(x.T, g, 1, 1)
  np.testing.assert_allclose(np.asarray(dw, np.float64), want, rtol=2e-6, atol=1e-9)


def batched_block_product(a, b, a_rows, b_rows):
  """The block product as one fp8 dot batched over the K chunks, [B, C, M, N] in fp32, each
  chunk scaled in fp32, then summed over the chunks."""
  (batch, m, _), n = a.shape, b.shape[1]
  pad, tile = _block_module._pad_to, _block_module.TILE
  a, b = pad(pad(a, 2, tile), 1, a_rows), pad(pad(b, 2, tile), 1, b_rows)
  s_a, s_b = tile_scales(a, a_rows, E4M3), tile_scales(b, b_rows, E4M3)
  expand = _block_module._expand
  q_a = fp8.quantize(a, expand(s_a, a_rows, tile), E4M3)
  q_b = fp8.quantize(b, expand(s_b, b_rows, tile), E4M3)
  chunks = a.shape[2] // tile
  q_a = q_a.reshape(batch, a.shape[1], chunks, tile)
  q_b = q_b.reshape(batch, b.shape[1], chunks, tile)
  dims = (((3,), (3,)), ((0, 2), (0, 2)))
  partial = lax.dot_general(q_a, q_b, dims, lax.Precision.HIGHEST, preferred_element_type=F32)
  row_a = jnp.repeat(s_a, a_rows, axis=1).transpose(0, 2, 1)[..., :, None]
  row_b = jnp.repeat(s_b, b_rows, axis=1).transpose(0, 2, 1)[..., None, :]
  return jnp.sum(partial * row_a * row_b, axis=1)[:, :m, :n]


@pytest.mark.parametrize("b_rows", [1, 128])
def test_block_loops_equal_the_batched_chunk_sum(b_rows, monkeypatch):
  """The loops over row tiles and K chunks against one dot batched over the chunks and a sum:
  the same quantized operands, scales and exact fp8 products, each chunk's sum in fp32 and
  scaled in fp32, the chunks added in fp32; only the order of each K=128 dot's fp32 sum is the
  backend's (XLA:CPU's two dot shapes differ in a few elements' last bits), so within
  2 x 128 x 2^-24 of the sum of |terms|. Rows in tiles of 7 (20 rows, padded to 21), K = 330
  padded to 3 chunks, chunks and rows 2^-30..2^30 apart; the bf16 result is the fp32 one
  rounded."""
  monkeypatch.setattr(_block_module, "ROW_TILE", 8)
  rng = np.random.default_rng(12)
  a = extreme_rows(rng, (1, 20, 330), -30, 30)
  a *= np.float32(np.repeat(2.0 ** rng.integers(-30, 30, (1, 1, 3)), 128, 2)[..., :330])
  b = extreme_rows(rng, (1, 150, 330), -10, 10)
  a, b = jnp.asarray(a), jnp.asarray(b)
  product = functools.partial(_block_module.block_product, precision=lax.Precision.HIGHEST)
  got = jax.jit(lambda a, b: product(a, b, 1, b_rows, E4M3, F32))(a, b)
  want = jax.jit(lambda a, b: batched_block_product(a, b, 1, b_rows))(a, b)
  terms = jax.jit(lambda a, b: batched_block_product(abs(a), abs(b), 1, b_rows))(a, b)
  got, want, terms = np.asarray(got), np.asarray(want), np.asarray(terms)
  assert np.all(np.abs(got - want) <= 2 * 128 * 2.0**-24 * terms)
  bf16 = jax.jit(lambda a, b: product(a, b, 1, b_rows, E4M3, jnp.bfloat16))(a, b)
  np.testing.assert_array_equal(np.asarray(bf16), np.asarray(jnp.asarray(got).astype(jnp.bfloat16)))


def test_block_gemms_are_one_row_tile_by_one_chunk(monkeypatch):
  """Every fp8 dot (forward and both gradients) is one K=128 chunk of one tile of at most
  ROW_TILE rows, with an fp32 result: no dot writes all K / 128 partial products."""
  monkeypatch.setattr(_block_module, "ROW_TILE", 16)
  x, w, g = (
    jnp.ones((40, 384), jnp.bfloat16),
    jnp.ones((384, 200), jnp.bfloat16),
    jnp.ones((40, 200), jnp.bfloat16),
  )
  dots = dot_general_avals(fp8.BlockScaling(), x, w, g)
  # y: 40 rows in 3 tiles of 14, N = 200 padded to 256; dx: the same rows, N = 384;
  # dw: w's 256 rows (padded) in 16 tiles of 16 by x's 384 columns, K = 40 tokens padded to 128.
  want = [(1, 14, 256), (1, 14, 384), (1, 16, 384)]
  assert sorted(out.shape for _, out in dots) == sorted(want)
  for operands, out in dots:
    assert [o.shape[-1] for o in operands] == [128, 128] and out.dtype == F32


def requantizing_block_vjp(x, w, g):
  """The output and both gradients with every product quantizing its high-precision operands
  (the backward's from x and w, requantized), in the canonical form."""
  t = lambda v: jnp.swapaxes(v, 1, 2)
  a, b, g, bf16 = x[None], w.T[None], g[None], jnp.bfloat16
  product = functools.partial(_block_module.block_product, dtype=E4M3, out_dtype=bf16)
  product = functools.partial(product, precision=lax.Precision.HIGHEST)
  y, da = product(a, b, 1, 128), product(g, t(b), 1, 128)
  return y[0], da[0], product(t(g), t(a), 1, 1)[0].T


@pytest.mark.parametrize("shape", [(40, 200, 130), (256, 128, 100)])
def test_block_saves_fp8_residuals_and_gives_the_requantized_results(shape):
  """The forward saves the weight's fp8 128 x 128 blocks (the backward transposes them) and
  x's fp8 1 x 128 tiles along the tokens, with fp32 scales, and no high-precision operand;
  the output and both gradients are bit for bit those of products that quantize x and w
  again. M, K, N = 40, 200, 130 are padded. (K and N are both over 128 or both not: with a
  single block along one of them only, XLA turns one layout's division by the broadcast scale
  into a product with its reciprocal, and w's fp8 values in the two layouts may differ at a
  rounding tie.)"""
  m, k, n = shape
  rng = np.random.default_rng(m)
  x, w, g = bf16_operands(rng, m, k, n)
  pad = lambda v: -(-v // 128) * 128
  assert vjp_residuals(fp8.BlockScaling(), x, w) == sorted([
    ("float8_e4m3fn", (1, pad(n), pad(k))), ("float32", (1, pad(n) // 128, pad(k) // 128)),
    ("float8_e4m3fn", (1, k, pad(m))), ("float32", (1, k, pad(m) // 128)),
  ])  # fmt: skip
  f = lambda x, w: fp8.dot_general(x, w, MATMUL, config=fp8.BlockScaling())
  y, (dx, dw) = value_and_vjp(f, x, w, g)
  for got, want in zip((y, dx, dw), jax.jit(requantizing_block_vjp)(x, w, g), strict=True):
    assert_bits_equal(got, want)
