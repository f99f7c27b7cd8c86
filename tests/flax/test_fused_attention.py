"""``jlf.dot_product_attention(implementation="cudnn")``: cuDNN's fused kernel where it runs,
jmp_lite's attention elsewhere, with the same semantics (checked against JAX's reference of the
kernel), and what the kernel cannot do refused; the deviceless H200 compile that shows the kernel
is in tests/test_deviceless_benchmark.py."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite.flax as jlf

BF16 = jnp.bfloat16
FUSED = functools.partial(jlf.dot_product_attention, implementation="cudnn")


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
  fused = jax.jit(lambda *a: _value_and_grads(FUSED, *a))
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


def test_where_jax_refuses_the_kernel_jmp_lites_attention_runs_and_the_caller_is_told(
  monkeypatch,
):
  def refuse(*args, implementation=None, **kwargs):
    raise NotImplementedError(f"no kernel for implementation={implementation!r}")

  monkeypatch.setattr(jax.nn, "dot_product_attention", refuse)
  q, k, v, bias, mask = _inputs(4)
  # Under jit both branches are traced (outside it, only this machine's).
  fused = jax.jit(lambda *a: FUSED(*a, is_causal=True))
  with pytest.warns(jlf.FusedAttentionUnavailableWarning, match="no kernel for") as caught:
    out = fused(q, k, v, bias, mask)
  assert [w.filename for w in caught] == [__file__]  # the warning points at the caller
  own = jax.jit(lambda *a: jlf.dot_product_attention(*a, is_causal=True))
  assert jnp.array_equal(out, own(q, k, v, bias, mask))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_semantics_match_the_kernels_reference_and_fp32(heads, kv_heads):
  # JAX's XLA implementation is the reference its cuDNN kernel is tested against: fp32 softmax,
  # bf16 probabilities for p @ v. jmp_lite's attention computes the same; both stay within bf16
  # rounding of the fp32 attention, fully masked row included.
  q, k, v, bias, mask = _inputs(1, heads, kv_heads)
  reference = lambda q, k, v, bias, mask: jax.nn.dot_product_attention(
    q, k, v, bias, mask, implementation="xla"
  )
  f32 = lambda *a: tuple(x.astype(jnp.float32) for x in a)

  @jax.jit  # the three as one program: run eagerly, each operation compiles on its own
  def all_three(q, k, v, bias, mask):
    return (
      _value_and_grads(FUSED, q, k, v, bias, mask),
      _value_and_grads(reference, q, k, v, bias, mask),
      _value_and_grads(reference, *f32(q, k, v, bias), mask),
    )

  with warnings.catch_warnings():  # traced, the cuDNN branch says where it cannot run
    warnings.simplefilter("ignore", jlf.FusedAttentionUnavailableWarning)
    (out, grads), (xla_out, xla_grads), (exact_out, exact_grads) = all_three(q, k, v, bias, mask)
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


def _told(caught) -> bool:
  return any(issubclass(w.category, jlf.FusedAttentionUnavailableWarning) for w in caught)


def test_in_a_flax_module_under_a_policy():
  model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  fused = jlf.ModuleOverride(attributes={"attention_fn": FUSED})
  policy = "params=float32,compute=bfloat16,output=float32"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    apply = jlf.policy_apply(
      model, jlf.ModulePolicies(policy, {nn.MultiHeadDotProductAttention: fused})
    )
    out = jax.jit(apply)(variables, x)
  assert _told(caught) == (not _cudnn_traces())  # the cuDNN route was taken
  assert out.dtype == jnp.float32
  assert jnp.array_equal(out, jax.jit(jlf.policy_apply(model, policy))(variables, x))


def test_in_an_nnx_module_under_a_policy():
  model = nnx.MultiHeadAttention(
    num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=nnx.Rngs(0)
  )
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  fused = jlf.ModuleOverride(attributes={"attention_fn": FUSED})
  policy = "params=float32,compute=bfloat16,output=float32"
  policies = jlf.ModulePolicies(policy, {nnx.MultiHeadAttention: fused})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = nnx.jit(lambda m, x: jlf.policy_view(m, policies)(x))(model, x)
  assert _told(caught) == (not _cudnn_traces())  # the cuDNN route was taken
  assert out.dtype == jnp.float32
  assert jnp.array_equal(out, nnx.jit(lambda m, x: jlf.policy_view(m, policy)(x))(model, x))


def _einsum(*args, **kwargs):
  return jnp.einsum(*args, **kwargs)


@pytest.mark.parametrize(
  ("kwargs", "named"),
  [
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "dropout_rate=0.1"),
    ({"module": nn.Dense(4)}, "module=Dense"),
    ({"einsum_dot_general": jax.lax.dot_general}, "einsum_dot_general="),
    (
      {"qk_attn_weights_einsum": _einsum, "attn_weights_value_einsum": _einsum},
      "qk_attn_weights_einsum=",
    ),
    ({"attn_weights_value_einsum": _einsum}, "attn_weights_value_einsum="),
  ],
)
def test_refuses_what_the_fused_kernel_cannot_do(kwargs, named):
  q, k, v, _, _ = _inputs(2)
  with pytest.raises(ValueError, match='implementation="xla"') as raised:
    FUSED(q, k, v, **kwargs)
  assert named in str(raised.value)


def test_refuses_inputs_not_of_rank_4():
  q, k, v, _, _ = _inputs(2)
  with pytest.raises(ValueError, match=r"\[batch, length, heads, depth\].*implementation=\"xla\""):
    FUSED(q[None], k[None], v[None])
  assert jlf.dot_product_attention(q[None], k[None], v[None]).shape == (1, *q.shape)


def _assert_close(fused, own):
  # Equal where jmp_lite's attention runs; within bf16 rounding where cuDNN's kernel does.
  assert fused.dtype == own.dtype
  fused, own = fused.astype(jnp.float32), own.astype(jnp.float32)
  np.testing.assert_allclose(fused, own, rtol=0, atol=2**-6 * float(jnp.max(jnp.abs(own))))


def test_dropout_off_is_not_refused():
  q, k, v, _, mask = _inputs(2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jlf.FusedAttentionUnavailableWarning)
    out = FUSED(q, k, v, mask=mask, dropout_rate=0.1, deterministic=True)
  _assert_close(out, jlf.dot_product_attention(q, k, v, mask=mask))


def test_dtype_and_promote_dtype_apply_as_in_the_xla_implementation():
  q, k, v, bias = (x.astype(jnp.float32) for x in _inputs(3)[:4])
  promote = lambda arrays, dtype: [x.astype(BF16) for x in arrays]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jlf.FusedAttentionUnavailableWarning)
    for kwargs in ({"dtype": BF16}, {"promote_dtype": promote}):
      out = FUSED(q, k, v, bias, **kwargs)
      assert out.dtype == BF16
      _assert_close(out, jlf.dot_product_attention(q, k, v, bias, **kwargs))


@pytest.mark.parametrize("implementation", ["cuda", "XLA", None, "auto"])
def test_an_unknown_implementation_is_refused_naming_the_accepted_ones(implementation):
  q, k, v, _, _ = _inputs(2)
  with pytest.raises(ValueError, match=f"{implementation!r}") as raised:
    jlf.dot_product_attention(q, k, v, implementation=implementation)
  assert "'xla', 'cudnn'" in str(raised.value)
