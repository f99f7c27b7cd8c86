import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite.flax as jlf

from .flax_testing import (
  BF16,
  F32,
  check_lean_products,
  eqns,
  in_dtypes,
  out_dtype,
  primitive_dtypes,
  products,
)


def _random(shape, seed, dtype=F32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def f32(x):
  return np.asarray(x).astype(np.float32)


def _residuals(fn, *args):
  """(dtype, shape) of the arrays jax.vjp(fn) keeps for the backward pass."""
  closed, (_, vjp_fn) = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
  n = len(jax.tree.leaves(vjp_fn))
  return [(np.dtype(v.aval.dtype), v.aval.shape) for v in closed.jaxpr.outvars[-n:]]


def _residual_dtypes(fn, *args):
  return [dtype for dtype, _ in _residuals(fn, *args)]


def test_softmax_is_fp32_inside_and_keeps_16bit_residuals():
  logits = _random((3, 7), 0, BF16)
  mask = np.random.default_rng(1).random((3, 7)) > 0.3
  mask[:, 0] = True

  weights = jnp.arange(7.0)
  ref_fn = lambda x: jax.nn.softmax(jnp.where(mask, x.astype(F32), -jnp.inf))

  @jax.jit
  def run(x):
    ours = lambda x: jlf.softmax(x, -1, mask)
    grad = jax.grad(lambda x: jnp.sum(ours(x).astype(F32) * weights))(x)
    ref_grad = jax.grad(lambda x: jnp.sum(ref_fn(x) * weights))(x.astype(F32))
    return ours(x), grad, ref_fn(x), ref_grad

  probs, grad, ref, ref_grad = run(logits)
  assert probs.dtype == BF16
  # fp32 inside, rounded once: exactly the rounded fp32 softmax.
  np.testing.assert_array_equal(f32(probs), np.asarray(ref).astype(BF16).astype(np.float32))
  assert (f32(probs)[~mask] == 0).all()
  np.testing.assert_allclose(f32(grad), ref_grad, atol=0.02 * float(np.abs(ref_grad).max()))
  jaxpr = jax.make_jaxpr(jax.grad(lambda x: jlf.softmax(x, -1, mask).astype(F32).sum()))(logits)
  assert primitive_dtypes(jaxpr, "exp") == {F32}
  assert primitive_dtypes(jaxpr, "reduce_sum") == {F32}
  # Only the 16-bit probabilities are kept, and one boolean per row (has it an unmasked
  # entry?): not the fp32 probabilities, the logits or the mask.
  assert _residuals(lambda x: jlf.softmax(x, -1, mask), logits) == [
    (BF16, (3, 7)),
    (np.dtype(bool), (3, 1)),
  ]
  assert _residuals(lambda x: jlf.softmax(x), logits) == [(BF16, (3, 7))]
  # A broadcast mask is reduced as given, never broadcast to the logits' shape.
  batch = _random((2, 4, 3, 7), 2, BF16)
  assert _residuals(lambda x: jlf.softmax(x, -1, mask[:1]), batch) == [
    (BF16, (2, 4, 3, 7)),
    (np.dtype(bool), (1, 1, 1, 1)),
  ]
  assert F32 in _residual_dtypes(lambda x: jax.nn.softmax(x.astype(F32)).astype(BF16), logits)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(jnp.float16)])
@pytest.mark.parametrize("magnitude", [1.0, 30.0, 1000.0])
def test_softmax_of_16bit_logits_is_the_rounded_fp32_softmax(dtype, magnitude):
  # The 16-bit form subtracts peak + log(total) in one step (so the fp32 x - peak is used once):
  # within one rounding of the fp32 softmax of the same 16-bit logits, fully masked rows 1/n.
  rng = np.random.default_rng(int(magnitude))
  logits = jnp.asarray((magnitude * rng.standard_normal((6, 64, 48))).astype(dtype))
  mask = rng.random((6, 64, 48)) > 0.4
  mask[0, 3] = False  # a fully masked row
  probs = jax.jit(lambda x: jlf.softmax(x, -1, mask))(logits)
  ref = np.array(jax.nn.softmax(jnp.where(mask, logits.astype(F32), -jnp.inf)))
  ref[0, 3] = 1 / 48
  rounded = ref.astype(dtype).astype(np.float32)
  ulp = np.spacing(np.abs(rounded).astype(dtype)).astype(np.float32)
  assert probs.dtype == dtype
  assert (np.abs(f32(probs) - rounded) <= ulp).all()
  assert np.mean(f32(probs) == rounded) > 0.99
  np.testing.assert_array_equal(f32(probs)[0, 3], rounded[0, 3])


def test_softmax_fp32_input_is_jax_softmax():
  x = _random((4, 5), 0)
  ours, ref = jax.jit(lambda x: (jlf.softmax(x), jax.nn.softmax(x)))(x)
  np.testing.assert_allclose(ours, ref, rtol=1e-6)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_dot_product_attention_matches_flax(heads, kv_heads):
  q, k, v = (
    _random((2, 5, heads, 8), 0),
    _random((2, 6, kv_heads, 8), 1),
    _random((2, 6, kv_heads, 8), 2),
  )
  mask = jnp.asarray(np.random.default_rng(3).random((2, 1, 5, 6)) > 0.2)
  bias = _random((1, heads, 5, 6), 4)

  @jax.jit
  def run(q, k, v):
    ours = jlf.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=True)
    half = jlf.dot_product_attention(
      *(x.astype(BF16) for x in (q, k, v)), bias=bias, mask=mask, is_causal=True
    )
    ref = nnx.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=True)
    return ours, half, ref

  ours, half, ref = run(q, k, v)
  np.testing.assert_allclose(ours, ref, atol=1e-5)
  assert half.dtype == BF16
  np.testing.assert_allclose(f32(half), ref, atol=0.05)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_dot_product_attention_gradients_match_flax_with_a_fully_masked_row(heads, kv_heads):
  # With as many key as query heads the backward pass takes its row sums from the output;
  # with grouped heads from the probabilities. Both are Flax's gradients in fp32, and the
  # fully masked row (uniform, independent of the logits) has Flax's gradient too.
  q, k, v = (
    _random((2, 5, heads, 8), 5),
    _random((2, 6, kv_heads, 8), 6),
    _random((2, 6, kv_heads, 8), 7),
  )
  mask = jnp.asarray(np.random.default_rng(8).random((2, 1, 5, 6)) > 0.2).at[1, 0, 2].set(False)
  bias, weights = _random((1, heads, 5, 6), 9), _random((2, 5, heads, 8), 10)

  def grads(attention):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, bias=bias, mask=mask) * weights)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  pairs = zip(grads(jlf.dot_product_attention), grads(nnx.dot_product_attention), strict=True)
  for ours, ref in pairs:
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_dot_product_attention_dropout_and_sow_match_flax():
  q, k, v = _random((2, 5, 2, 4), 0), _random((2, 5, 2, 4), 1), _random((2, 5, 2, 4), 2)
  kwargs = dict(dropout_rng=jax.random.key(0), dropout_rate=0.3, deterministic=False)

  class Sower(nn.Module):
    @nn.compact
    def __call__(self, q):
      return jlf.dot_product_attention(q, q, q, module=self)

  @jax.jit
  def run(q, k, v):
    ours = jlf.dot_product_attention(q, k, v, **kwargs)
    _, state = Sower().apply({}, q, mutable=["intermediates"])
    return ours, nn.dot_product_attention(q, k, v, **kwargs), state

  ours, ref, state = run(q, k, v)
  np.testing.assert_allclose(ours, ref, atol=1e-5)  # the same dropout mask as Flax
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (2, 2, 5, 5)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def test_dot_product_attention_runs_16_bit_products_forward_and_backward():
  q = _random((2, 5, 2, 4), 0, BF16)
  loss = lambda q: jlf.dot_product_attention(q, q, q).astype(F32).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
  # 2 forward, 4 backward matmuls, and the softmax backward's row sums <dp, p>: a
  # dot product of the 16-bit arrays with an fp32 result, so dp is never widened.
  assert check_lean_products(jaxpr, wide=1) >= 7
  (row_sums,) = [e for e in products(jaxpr) if out_dtype(e) == F32]
  assert in_dtypes(row_sums) == (BF16, BF16) and row_sums.outvars[0].aval.shape == (2, 2, 5)
  assert primitive_dtypes(jaxpr, "exp") == {F32}


def test_dot_product_attention_custom_einsums_replace_the_default():
  calls = []

  def einsum(*args, **kwargs):
    calls.append(args[0])
    return jnp.einsum(*args, **kwargs)

  q = _random((1, 3, 2, 4), 0)
  out = jax.eval_shape(
    lambda q: jlf.dot_product_attention(
      q, q, q, qk_attn_weights_einsum=einsum, attn_weights_value_einsum=einsum
    ),
    q,
  )
  assert len(calls) == 2 and out.shape == q.shape
  # The softmax is still ours (fp32 for 16-bit inputs).
  jaxpr = jax.make_jaxpr(
    lambda q: jlf.dot_product_attention(
      q, q, q, qk_attn_weights_einsum=einsum, attn_weights_value_einsum=einsum
    )
  )(q.astype(BF16))
  assert primitive_dtypes(jaxpr, "exp") == {F32}
  assert any(e.primitive.name == "custom_vjp_call" for e in eqns(jaxpr))


@pytest.mark.parametrize(
  "shapes, kwargs, match",
  [
    (((2, 3, 4, 8), (2, 3, 3, 8), (2, 3, 3, 8)), {}, "multiple of key/value heads"),
    (((3, 4, 8), (3, 4, 8), (2, 3, 4, 8)), {}, "same rank"),
    (((2, 3, 2, 8),) * 3, {"qk_attn_weights_einsum": jnp.einsum}, "given together"),
  ],
)
def test_dot_product_attention_rejects_bad_input(shapes, kwargs, match):
  q, k, v = (jnp.zeros(s) for s in shapes)
  with pytest.raises(ValueError, match=match):
    jlf.dot_product_attention(q, k, v, **kwargs)
