import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax_testing import BF16, F16, F32, check_fp32_accumulation, check_hlo_fp32_accumulation
from jax import lax

import jmp_lite.flax as jlf

DOT_CASES = [
  # (lhs shape, rhs shape, dimension numbers)
  ((4, 8), (8, 3), (((1,), (0,)), ((), ()))),
  ((3, 4, 5, 6), (3, 6, 5, 7), (((3, 2), (1, 2)), ((0,), (0,)))),  # 2 contracting, batch
  ((2, 3, 4, 5), (5, 6, 7), (((3,), (0,)), ((), ()))),  # several free dims on each side
  ((6, 2, 5), (5, 2, 3), (((2,), (0,)), ((1,), (1,)))),  # batch dim not leading
]


def _random(shape, seed, dtype):
  # Made on the host: every eager JAX op would compile an executable.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def f32(x):
  return np.asarray(x).astype(np.float32)


def _compare(ours, ref, operands, weights_seed=2):
  """Jitted forward and gradients of ``ours`` (16-bit) and ``ref`` (fp32)."""

  weights = _random(jax.eval_shape(ours, *operands).shape, weights_seed, F32)

  def run(*ops):
    out = ours(*ops)
    # Linear in the output, so both runs back-propagate the same cotangent.
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(F32) * weights)
    argnums = tuple(range(len(ops)))
    grads = jax.grad(loss(ours), argnums)(*ops)
    wide = [o.astype(F32) for o in ops]
    return out, grads, ref(*wide), jax.grad(loss(ref), argnums)(*wide)

  grad_fn = lambda *ops: jax.grad(
    lambda *a: jnp.sum(ours(*a).astype(F32) ** 2), tuple(range(len(ops)))
  )(*ops)
  return (
    jax.jit(run)(*operands),
    jax.make_jaxpr(grad_fn)(*operands),
    jax.jit(grad_fn).lower(*operands).as_text(),
  )


@pytest.mark.parametrize(
  "dtype, lhs_shape, rhs_shape, dims",
  [(BF16, *case) for case in DOT_CASES] + [(F16, *DOT_CASES[1])],
)
def test_dot_general_matches_fp32_forward_and_backward(dtype, lhs_shape, rhs_shape, dims):
  x, y = _random(lhs_shape, 0, dtype), _random(rhs_shape, 1, dtype)
  ours = lambda a, b: jlf.dot_general(a, b, dims)
  ref = lambda a, b: lax.dot_general(a, b, dims)
  (out, grads, ref_out, ref_grads), jaxpr, hlo = _compare(ours, ref, (x, y))
  eps = float(jnp.finfo(dtype).eps)
  assert out.dtype == dtype
  np.testing.assert_allclose(f32(out), ref_out, rtol=eps, atol=eps * 8)
  for g, r in zip(grads, ref_grads, strict=True):
    assert g.dtype == dtype and g.shape == r.shape
    np.testing.assert_allclose(f32(g), r, atol=4 * eps * float(np.abs(r).max()))
  # Forward and both backward products: 16-bit operands, fp32 accumulation.
  assert check_fp32_accumulation(jaxpr, dtype) >= 3
  assert check_hlo_fp32_accumulation(hlo, "bf16" if dtype == BF16 else "f16") >= 3


def test_jax_default_accumulates_in_16_bits():
  # Why jmp_lite's kernels exist: JAX asks for a bf16 result, and the check sees it.
  x = jnp.ones((4, 8), BF16)
  jaxpr = jax.make_jaxpr(lambda a: a @ a.T)(x)
  with pytest.raises(AssertionError, match="16-bit"):
    check_fp32_accumulation(jaxpr)


@pytest.mark.parametrize(
  "lhs, rhs, pref",
  [(F32, F32, None), (BF16, F32, None), (BF16, BF16, F32), (F16, BF16, None)],
)
def test_dot_general_passes_other_operands_to_lax(lhs, rhs, pref):
  x, y = jnp.ones((2, 3), lhs), jnp.ones((3, 4), rhs)
  dims = (((1,), (0,)), ((), ()))
  ours = jax.make_jaxpr(lambda a, b: jlf.dot_general(a, b, dims, preferred_element_type=pref))(x, y)
  ref = jax.make_jaxpr(lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=pref))(x, y)
  assert str(ours) == str(ref)


@pytest.mark.parametrize(
  "strides, padding, lhs_dilation, rhs_dilation, groups",
  [((1, 1), "SAME", None, None, 1), ((2, 1), ((1, 0), (0, 1)), (2, 1), (1, 2), 2)],
)
def test_conv_general_dilated_matches_fp32(strides, padding, lhs_dilation, rhs_dilation, groups):
  x = _random((2, 7, 6, 4), 0, BF16)
  w = _random((3, 3, 4 // groups, 6), 1, BF16)
  kwargs = dict(
    window_strides=strides,
    padding=padding,
    lhs_dilation=lhs_dilation,
    rhs_dilation=rhs_dilation,
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
    feature_group_count=groups,
  )
  ours = lambda a, b: jlf.conv_general_dilated(a, b, **kwargs)
  ref = lambda a, b: lax.conv_general_dilated(a, b, **kwargs)
  (out, grads, ref_out, ref_grads), jaxpr, hlo = _compare(ours, ref, (x, w))
  assert out.dtype == BF16
  np.testing.assert_allclose(f32(out), ref_out, rtol=1e-2, atol=3e-2)
  for g, r in zip(grads, ref_grads, strict=True):
    assert g.dtype == BF16
    np.testing.assert_allclose(f32(g), r, atol=0.02 * float(np.abs(r).max()))
  assert check_fp32_accumulation(jaxpr) >= 3  # forward, input gradient, weight gradient
  assert check_hlo_fp32_accumulation(hlo) == 3


def test_einsum_contracts_through_fp32_accumulation():
  q, k = _random((2, 5, 3, 4), 0, BF16), _random((2, 6, 3, 4), 1, BF16)
  ours = lambda a, b: jlf.einsum("bqhd,bkhd->bhqk", a, b)
  ref = lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b)
  (out, grads, ref_out, ref_grads), jaxpr, _ = _compare(ours, ref, (q, k))
  assert out.dtype == BF16
  np.testing.assert_allclose(f32(out), ref_out, rtol=1e-2, atol=2e-2)
  np.testing.assert_allclose(
    f32(grads[0]), ref_grads[0], atol=0.02 * float(np.abs(ref_grads[0]).max())
  )
  assert check_fp32_accumulation(jaxpr) >= 3
  with pytest.raises(TypeError, match="_dot_general"):
    jlf.einsum("ij,jk->ik", q[0, 0], k[0, 0].T, _dot_general=lax.dot_general)


def test_transforms_jit_vmap_scan():
  dims = (((1,), (0,)), ((), ()))
  x, w = _random((5, 4, 8), 0, BF16), _random((8, 3), 1, BF16)
  loss = lambda w, x: jnp.sum(jlf.dot_general(x, w, dims).astype(F32) ** 2)

  def body(total, xi):
    return total + jax.grad(loss)(w, xi).astype(F32), jax.grad(loss)(w, xi)

  @jax.jit
  def run(w, x):
    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, x)
    return per_example, jax.lax.scan(body, jnp.zeros((8, 3), F32), x)

  per_example, (total, looped) = run(w, x)
  np.testing.assert_array_equal(per_example, looped)
  np.testing.assert_allclose(total, f32(looped).sum(0), rtol=1e-6)
  # Checkpointed: the recomputed forward accumulates in fp32 too.
  jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(loss)))(w, x[0])
  assert check_fp32_accumulation(jaxpr) >= 2


def test_forward_mode_is_rejected_clearly():
  dims = (((1,), (0,)), ((), ()))
  x = jnp.ones((2, 2), BF16)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda a: jlf.dot_general(a, a, dims), (x,), (x,))
