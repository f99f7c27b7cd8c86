"""``jlf.fused_dot_product_attention``: cuDNN's fused kernel where it runs, jmp_lite's attention
elsewhere, with the same semantics (checked against JAX's reference of the kernel); the
deviceless H200 compile that shows the kernel is in tests/test_deviceless_benchmark.py."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite.flax as jlf

BF16 = jnp.bfloat16


def _cudnn_traces() -> bool:
  """Whether this JAX can trace cuDNN's attention kernel (False on a CPU-only jaxlib)."""
  q = jnp.zeros((1, 8, 2, 8), BF16)
  try:
    jax.make_jaxpr(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))(q)
  except RuntimeError:
    return False
  return True


def _inputs(seed, heads=4, kv_heads=4, length=16, depth=8):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (2, length, heads, depth), BF16)
  k, v = (jax.random.normal(key, (2, length, kv_heads, depth), BF16) for key in keys[1:3])
  bias = jax.random.normal(keys[3], (1, heads, length, length), BF16)
  mask = nn.make_causal_mask(jnp.zeros((2, length))).astype(jnp.bool_)
  mask = mask.at[1, 0, 3].set(False)  # a fully masked row: uniform attention, as in Flax
  return q, k, v, bias, mask


def _loss(attention, bias, mask):
  return lambda q, k, v: jnp.sum(
    attention(q, k, v, bias=bias, mask=mask).astype(jnp.float32) * jnp.arange(8.0)
  )


def _value_and_grads(attention, q, k, v, bias, mask):
  loss = _loss(attention, bias, mask)
  out = attention(q, k, v, bias=bias, mask=mask)
  return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_under_jit_runs_jmp_lite_attention_and_says_so_where_cudnn_cannot_run():
  q, k, v, bias, mask = _inputs(0)
  fused = jax.jit(lambda *a: _value_and_grads(jlf.fused_dot_product_attention, *a))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, grads = fused(q, k, v, bias, mask)
  told = [w for w in caught if issubclass(w.category, jlf.FusedAttentionUnavailableWarning)]
  # Lowered for this machine's CPU, the program holds jmp_lite's attention either way; the
  # fused kernel's branch is traced too, and where JAX cannot trace it (no cuDNN) the user is
  # told, once per traced call (the forward one, the differentiated one).
  assert len(told) == (0 if _cudnn_traces() else 2)
  if told:
    assert "cuDNN" in str(told[0].message)
  ref_out, ref_grads = jax.jit(lambda *a: _value_and_grads(jlf.dot_product_attention, *a))(
    q, k, v, bias, mask
  )
  assert out.dtype == BF16 and jnp.array_equal(out, ref_out)
  for g, ref in zip(grads, ref_grads, strict=True):
    assert g.dtype == BF16 and jnp.array_equal(g, ref)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_semantics_match_the_kernels_reference_and_fp32(heads, kv_heads):
  # JAX's XLA implementation is the reference its cuDNN kernel is tested against: fp32 softmax,
  # bf16 probabilities for p @ v. jmp_lite's attention computes the same; both stay within bf16
  # rounding of the fp32 attention, fully masked row included.
  q, k, v, bias, mask = _inputs(1, heads, kv_heads)
  reference = lambda q, k, v, bias, mask: jax.nn.dot_product_attention(
    q, k, v, bias, mask, implementation="xla"
  )
  out, grads = _value_and_grads(jlf.fused_dot_product_attention, q, k, v, bias, mask)
  xla_out, xla_grads = _value_and_grads(reference, q, k, v, bias, mask)
  f32 = lambda *a: tuple(x.astype(jnp.float32) for x in a)
  exact_out, exact_grads = _value_and_grads(reference, *f32(q, k, v, bias), mask)
  scale = lambda x: float(jnp.max(jnp.abs(x)))
  triples = zip((out, *grads), (xla_out, *xla_grads), (exact_out, *exact_grads), strict=True)
  for got, xla, exact in triples:
    got, xla = got.astype(jnp.float32), xla.astype(jnp.float32)
    assert scale(got - exact) <= 2**-6 * scale(exact)  # bf16 inputs and products
    assert scale(got - xla) <= 2**-6 * scale(exact)
  # The fully masked row attends uniformly: the mean of the values, in both.
  row = jnp.mean(v.astype(jnp.float32)[1], axis=0)
  if heads == kv_heads:
    np.testing.assert_allclose(out[1, 3].astype(jnp.float32), row, atol=2**-6)
    np.testing.assert_allclose(xla_out[1, 3].astype(jnp.float32), row, atol=2**-6)


def test_in_a_flax_module_under_a_policy():
  model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  fused = jlf.ModuleOverride(attributes={"attention_fn": jlf.fused_dot_product_attention})
  policy = "params=float32,compute=bfloat16,output=float32"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jlf.FusedAttentionUnavailableWarning)
    apply = jlf.policy_apply(
      model, jlf.ModulePolicies(policy, {nn.MultiHeadDotProductAttention: fused})
    )
    out = jax.jit(apply)(variables, x)
  assert out.dtype == jnp.float32
  assert jnp.array_equal(out, jax.jit(jlf.policy_apply(model, policy))(variables, x))


def test_refuses_what_the_fused_kernel_cannot_do():
  q, k, v, _, mask = _inputs(2)
  with pytest.raises(ValueError, match="no dropout"):
    jlf.fused_dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  # deterministic: dropout is off, nothing refused
  jlf.fused_dot_product_attention(q, k, v, mask=mask, dropout_rate=0.1, deterministic=True)
  with pytest.raises(ValueError, match="sow"):
    jlf.fused_dot_product_attention(q, k, v, module=object())
  with pytest.raises(ValueError, match=r"\[batch, length, heads, depth\]"):
    jlf.fused_dot_product_attention(q[None], k[None], v[None])
