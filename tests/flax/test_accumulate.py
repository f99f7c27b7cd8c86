import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite.flax as jlf

from .flax_testing import (
  BF16,
  F16,
  F32,
  check_hlo_products,
  check_lean_products,
  hlo_products,
  in_dtypes,
  out_dtype,
  products,
)

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
def test_dot_general_is_jaxs_16bit_product(dtype, lhs_shape, rhs_shape, dims):
  # On CPU nothing is declared: the kernel is exactly JAX's 16-bit product,
  # forward and backward (the same matmuls as a Flax layer with dtype=bf16).
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
  assert check_lean_products(jaxpr, dtype) == 3  # forward, both gradients
  assert check_hlo_products(hlo, "bf16" if dtype == BF16 else "f16") == 3
  plain = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(ref(a, b).astype(F32) ** 2)))(x, y)
  assert str(plain) == str(
    jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(ours(a, b).astype(F32) ** 2)))(x, y)
  )


def _exact_case(dtype, k):
  """Integer operands whose fp32 sums are exact and whose 16-bit sums are not.

  Row 0 of ``x`` is [2^9, 1, 1, ...]: a 16-bit accumulator stops growing at
  2^9 + 2^9 * eps, an fp32 one reaches 2^9 + k - 1 exactly.
  """
  rng = np.random.default_rng(k)
  x = rng.integers(-2, 3, (3, k)).astype(np.float32)
  x[0] = 1.0
  x[0, 0] = 512.0
  w = rng.integers(-2, 3, (k, 4)).astype(np.float32)
  w[:, 0] = 1.0
  return x, w


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cpu_accumulates_16bit_products_in_fp32(dtype):
  # What the kernels rely on where nothing is declared (XLA:CPU): forward and
  # both gradient products equal the exact sum, rounded once to 16 bits.
  x, w = _exact_case(dtype, 1024)
  dims = (((1,), (0,)), ((), ()))
  g = np.ones((3, 4), np.float32)
  run = jax.jit(
    lambda x, w, g: (
      jlf.dot_general(x, w, dims),
      *jax.vjp(lambda a, b: jlf.dot_general(a, b, dims), x, w)[1](g),
    )
  )
  out, dx, dw = run(*(jnp.asarray(a, dtype) for a in (x, w, g)))
  rounded = lambda a: np.asarray(jnp.asarray(a, dtype)).astype(np.float32)  # one rounding
  np.testing.assert_array_equal(f32(out), rounded(x @ w))
  np.testing.assert_array_equal(f32(dx), rounded(g @ w.T))
  np.testing.assert_array_equal(f32(dw), rounded(x.T @ g))
  assert f32(out)[0, 0] == rounded(512.0 + 1023)  # a 16-bit accumulator stalls at 512 + 512 * eps


@pytest.mark.parametrize("platform", ["cuda", "tpu", "cpu"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_no_precision_is_declared_for_any_platform(platform, dtype):
  # Every backend accumulates 16-bit products in fp32 undeclared, and XLA:TPU compiles the
  # BF16_BF16_F32 preset to the program it compiles without one
  # (tests/test_deviceless_benchmark.py): the trace names no platform, so one trace lowers the
  # same products for each.
  x, y = _random((4, 8), 0, dtype), _random((8, 3), 1, dtype)
  dims = (((1,), (0,)), ((), ()))
  loss = lambda a, b: jnp.sum(jlf.dot_general(a, b, dims).astype(F32) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, y)
  assert check_lean_products(jaxpr, dtype) == 3
  hlo = jax.jit(jax.grad(loss, (0, 1))).trace(x, y).lower(lowering_platforms=(platform,)).as_text()
  narrow = "bf16" if dtype == BF16 else "f16"
  assert check_hlo_products(hlo, narrow) == 3


def test_wide_output_and_wide_weight_gradient():
  x, w = _random((4, 8), 0, BF16), _random((8, 3), 1, BF16)
  dims = (((1,), (0,)), ((), ()))
  exact = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=F32)
  plain = lambda a, b: lax.dot_general(a, b, dims)
  # output_dtype: the unrounded fp32 product; its gradients are 16-bit products
  # of the cotangent rounded once.
  wide = lambda a, b: jlf.dot_general(a, b, dims, output_dtype=F32)
  np.testing.assert_array_equal(wide(x, w), exact(x, w))
  g = _random((4, 3), 3, F32)
  grads = jax.vjp(wide, x, w)[1](g)
  ref = jax.vjp(plain, x, w)[1](g.astype(BF16))
  for a, b in zip(grads, ref, strict=True):
    assert a.dtype == BF16
    np.testing.assert_array_equal(f32(a), f32(b))
  jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(wide(a, b) ** 2), (0, 1)))(x, w)
  assert check_lean_products(jaxpr, wide=1) == 3
  # rhs_grad_dtype: the weight gradient leaves its matmul in fp32 and is rounded once.
  reduced = lambda a, b: jlf.dot_general(a, b, dims, rhs_grad_dtype=F32)
  gb = g.astype(BF16)
  dx, dw = jax.vjp(reduced, x, w)[1](gb)
  np.testing.assert_array_equal(f32(dx), f32(ref[0]))
  dw_exact = lax.dot_general(x, gb, (((0,), (0,)), ((), ())), preferred_element_type=F32)
  np.testing.assert_array_equal(f32(dw), f32(dw_exact.astype(BF16)))
  jaxpr = jax.make_jaxpr(lambda a, b, c: jax.vjp(reduced, a, b)[1](c))(x, w, gb)
  assert check_lean_products(jaxpr, wide=1) == 3  # the (dead) forward, both gradients
  # Under vmap and jit too.
  batched = jax.jit(jax.vmap(lambda a, c: jax.vjp(reduced, a, w)[1](c)))(x[None], gb[None])
  np.testing.assert_array_equal(f32(batched[1][0]), f32(dw))
  with pytest.raises(ValueError, match="output_dtype must be None or float32"):
    jlf.dot_general(x, w, dims, output_dtype=jnp.float16)


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
  assert check_lean_products(jaxpr) == 3  # forward, input gradient, weight gradient
  assert check_hlo_products(hlo) == 3
  # The kernel gradient in fp32 (rounded once): what an fp32 reduction under FSDP sums.
  wide = lambda a, b: jlf.conv_general_dilated(a, b, rhs_grad_dtype=F32, **kwargs)
  g = _random(out.shape, 3, BF16)
  dx, dw = jax.vjp(wide, x, w)[1](g)
  ref_dx, _ = jax.vjp(ref, x, w)[1](g)
  np.testing.assert_array_equal(f32(dx), f32(ref_dx))
  exact_dw = jax.vjp(lambda b: ref(x.astype(F32), b), w.astype(F32))[1](g.astype(F32))[0]
  np.testing.assert_allclose(f32(dw), exact_dw, rtol=2**-8, atol=1e-6)


def test_einsum_contracts_in_16_bit_products():
  q, k = _random((2, 5, 3, 4), 0, BF16), _random((2, 6, 3, 4), 1, BF16)
  ours = lambda a, b: jlf.einsum("bqhd,bkhd->bhqk", a, b)
  ref = lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b)
  (out, grads, ref_out, ref_grads), jaxpr, _ = _compare(ours, ref, (q, k))
  assert out.dtype == BF16
  np.testing.assert_allclose(f32(out), ref_out, rtol=1e-2, atol=2e-2)
  np.testing.assert_allclose(
    f32(grads[0]), ref_grads[0], atol=0.02 * float(np.abs(ref_grads[0]).max())
  )
  assert check_lean_products(jaxpr) == 3
  wide = jlf.einsum("bqhd,bkhd->bhqk", q, k, output_dtype=F32)
  np.testing.assert_array_equal(
    wide, jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32)
  )
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
  # Checkpointed: the recomputed forward is a 16-bit product too.
  jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(loss)))(w, x[0])
  assert check_lean_products(jaxpr) >= 2


def test_forward_mode_works_without_options_and_is_refused_with_them():
  dims = (((1,), (0,)), ((), ()))
  x = _random((2, 2), 0, BF16)
  tangent = jax.jvp(lambda a: jlf.dot_general(a, a, dims), (x,), (x,))[1]
  np.testing.assert_array_equal(f32(tangent), f32(jax.jvp(lambda a: a @ a, (x,), (x,))[1]))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda a: jlf.dot_general(a, a, dims, output_dtype=F32), (x,), (x,))


@pytest.mark.parametrize("subscripts", ["btd,dhk->bthk", "btd,dhk->hkbt"])
def test_einsum_widens_the_kernel_gradient_wherever_einsum_puts_the_kernel(subscripts):
  # jnp.einsum contracts with the kernel on the left when the output lists its axes first.
  x, k = _random((2, 3, 4), 0, BF16), _random((4, 5, 6), 1, BF16)
  ours = lambda a, b: jlf.einsum(subscripts, a, b, rhs_grad_dtype=F32)
  plain = lambda a, b: jnp.einsum(subscripts, a, b)
  g = _random(jax.eval_shape(plain, x, k).shape, 2, BF16)
  dx, dk = jax.vjp(ours, x, k)[1](g)
  ref_dx, _ = jax.vjp(plain, x, k)[1](g)
  np.testing.assert_array_equal(f32(dx), f32(ref_dx))  # the input gradient: 16-bit, as JAX's
  exact_dk = jax.vjp(lambda b: plain(x.astype(F32), b), k.astype(F32))[1](g.astype(F32))[0]
  np.testing.assert_array_equal(f32(dk), f32(exact_dk.astype(BF16)))  # fp32 sum, rounded once
  jaxpr = jax.make_jaxpr(lambda a, b, c: jax.vjp(ours, a, b)[1](c))(x, k, g)
  # The product off CPU (on CPU its operands are widened first: see the tests below).
  wide = [e for e in products(jaxpr) if out_dtype(e) == F32 and in_dtypes(e) == (BF16, BF16)]
  assert len(wide) == 1 and sorted(wide[0].outvars[0].aval.shape) == sorted(k.shape)


# Kernel gradients under rhs_grad_dtype=float32 (a bf16 x bf16 -> f32 product). Into "dense"'s
# (a Dense layer on [batch, length, features]) XLA:CPU folds a transpose of the result, a form
# it then cannot run on bf16 operands ("Unsupported element type for DotThunk: BF16 x BF16 =
# F32"); the other layers' forms ran before too.
# name: (input shape, kernel shape, dimension numbers or einsum subscripts)
WIDE_GRADIENTS = {
  "dense": ((2, 8, 16), (16, 32), (((2,), (0,)), ((), ()))),
  "dense_2d": ((16, 16), (16, 32), (((1,), (0,)), ((), ()))),
  "dense_general": ((2, 8, 16), (16, 2, 8), (((2,), (0,)), ((), ()))),
  "attention_out": ((2, 8, 2, 8), (2, 8, 16), (((2, 3), (0, 1)), ((), ()))),
  "einsum": ((2, 8, 16), (16, 2, 8), "btd,dhk->bthk"),
}


def _layer_product(spec):
  """The product of a WIDE_GRADIENTS case: the layer's input times its kernel."""
  if isinstance(spec, str):
    return lambda a, b, **kw: jlf.einsum(spec, a, b, **kw)
  return lambda a, b, **kw: jlf.dot_general(a, b, spec, **kw)


def _integers(shape, seed):
  """Small integers and one 512: exact fp32 sums that a 16-bit accumulator would round."""
  x = np.random.default_rng(seed).integers(-2, 3, shape).astype(np.float32)
  x.flat[0] = 512.0
  return x


@jax.jit
def _wide_gradients(operands, cotangents):
  """Per case: both gradients with rhs_grad_dtype=float32 and without it."""
  results = {}
  for name, (_, _, spec) in WIDE_GRADIENTS.items():
    product = _layer_product(spec)
    wide = functools.partial(product, rhs_grad_dtype=F32)
    results[name] = tuple(jax.vjp(p, *operands[name])[1](cotangents[name]) for p in (wide, product))
  return results


def test_wide_kernel_gradients_run_on_cpu():
  # Jitted (where XLA:CPU folds the transpose): the kernel gradient is the exact fp32 sum
  # rounded once, as without the option (on one device the two differ only in the dtype
  # they would be reduced in across devices); the input gradient is untouched.
  operands, cotangents = {}, {}
  for seed, (name, (x_shape, w_shape, spec)) in enumerate(WIDE_GRADIENTS.items()):
    x, w = _integers(x_shape, 3 * seed).astype(BF16), _integers(w_shape, 3 * seed + 1).astype(BF16)
    operands[name] = x, w
    out = jax.eval_shape(_layer_product(spec), x, w)
    cotangents[name] = _integers(out.shape, 3 * seed + 2).astype(BF16)
  results = _wide_gradients(operands, cotangents)
  for name, ((dx, dw), (ref_dx, ref_dw)) in results.items():
    x, w, g = (a.astype(F32) for a in (*operands[name], cotangents[name]))
    _, exact_dw = jax.vjp(_layer_product(WIDE_GRADIENTS[name][2]), x, w)[1](g)
    assert dw.dtype == BF16 and dx.dtype == BF16, name
    np.testing.assert_array_equal(f32(dw), f32(exact_dw.astype(BF16)), err_msg=name)
    np.testing.assert_array_equal(f32(dw), f32(ref_dw), err_msg=name)
    np.testing.assert_array_equal(f32(dx), f32(ref_dx), err_msg=name)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_wide_kernel_gradient_keeps_16bit_operands_off_cpu(platform):
  # Only XLA:CPU gets widened operands. Lowered for a GPU or TPU, the kernel gradient is the
  # bf16 x bf16 -> f32 product and no product of the CPU form is left; the same trace lowered
  # for CPU has it.
  x, w = _random((2, 8, 16), 0, BF16), _random((16, 32), 1, BF16)
  dims = (((2,), (0,)), ((), ()))
  loss = lambda a, b: jnp.sum(jlf.dot_general(a, b, dims, rhs_grad_dtype=F32).astype(F32) ** 2)
  traced = jax.jit(jax.grad(loss, (0, 1))).trace(x, w)
  hlo = traced.lower(lowering_platforms=(platform,)).as_text()
  assert check_hlo_products(hlo, wide=1) == 3  # forward, both gradients
  assert {types for *_, types in _operand_types(hlo)} == {("bf16", "bf16")}
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert check_hlo_products(cpu) == 2  # the forward, the input gradient
  assert ("32x16xf32", ("f32", "f32")) in _operand_types(cpu)  # the kernel gradient, transposed


def _operand_types(hlo):
  """(result type, (lhs dtype, rhs dtype)) of every product in StableHLO text."""
  dtype = lambda t: t.split("x")[-1]
  return [(result, (dtype(lhs), dtype(rhs))) for _, _, lhs, rhs, result in hlo_products(hlo)]
