"""Differential tests: every op jmp_lite's Flax policy substitutes, against Flax's or JAX's own.

* Called directly on fp32 operands, jmp_lite's ops are Flax's/JAX's: outputs and gradients
  agree to fp32 rounding (exactly where the op is passed straight through).
* On 16-bit operands holding small integers every product and partial sum is exact, so the
  fp32-accumulating kernels must equal the fp32 reference rounded once, exactly.
* Through ``policy_apply`` with bf16 compute, every gradient leaf of a small model built around
  one substituted or overridden layer is within 5% (norm of the difference over the norm of the
  reference) of plain Flax in fp32.

Compiling dominates the run time on 2 cores, so shapes come from small fixed sets that every
example runs (hypothesis draws the data, the masks, which rows are fully masked), and the static
options (mask rank, causal, dropout, with or without a mask or bias) are enumerated inside one
jitted function rather than drawn: one compile serves every example.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax import lax

import jmp_lite.flax as jlf

from .flax_testing import BF16, F16, F32, LinenLM, jit, leaf_rel_errors, lm_loss, tokens

POLICY = "p=f32,c=bf16,o=f32"
FP32_TOL = dict(rtol=1e-5, atol=1e-6)

seeds = st.integers(0, 2**16)


def _normal(rng, shape, dtype=F32):
  # Made on the host: an eager JAX op would compile an executable per shape.
  return rng.standard_normal(shape).astype(dtype)


def _masked_out(draw, shape):
  """A mask of ``shape`` (True = attend): the rows hypothesis picks are fully masked, the
  others have entries masked with a drawn probability (random bits from a drawn seed)."""
  rng = np.random.default_rng(draw(seeds))
  mask = rng.random(shape) >= draw(st.sampled_from([0.0, 0.3, 0.6]))
  rows = int(np.prod(shape[:-1]))
  dead = np.array(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)), bool)
  return mask & ~dead.reshape((*shape[:-1], 1))


def _flax_softmax(x, axis, where):
  """Flax's attention masking: masked logits set to finfo.min, then jax.nn.softmax."""
  if where is not None:
    x = jnp.where(where, x, jnp.finfo(x.dtype).min)
  return jax.nn.softmax(x, axis=axis)


# --------------------------------------------------------------------------------------------
# The fully masked row: uniform output, zero gradient.


@jit
def _fully_masked_rows(z, m, c, q, k, v, bias, mask, ct):
  results = {}
  loss = lambda f: lambda logits: jnp.sum(f(logits, where=m).astype(F32) * c)
  for dtype in (F32, BF16):
    x = z.astype(dtype)
    results[np.dtype(dtype).name] = (jlf.softmax(x, where=m), jax.grad(loss(jlf.softmax))(x))
  results["jax"] = jax.grad(loss(jax.nn.softmax))(z)

  def attention_loss(attention):
    return lambda q, k, bias: jnp.sum(attention(q, k, v, bias=bias, mask=mask) * ct)

  for name, attention in [("ours", jlf.dot_product_attention), ("flax", nn.dot_product_attention)]:
    results[name] = jax.grad(attention_loss(attention), (0, 1, 2))(q, k, bias)
  return results


def test_fully_masked_row_has_zero_gradient():
  z = np.array([[0.3, -1.0, 2.0], [0.5, 0.0, -0.5]], F32)
  m = np.array([[False, False, False], [True, False, True]])
  c = np.array([1.0, 2.0, 3.0], F32)
  # Attention: the first query of the first head sees no key.
  rng = np.random.default_rng(0)
  q, k, v, ct = (_normal(rng, (1, 2, 2, 4)) for _ in range(4))
  bias = _normal(rng, (1, 2, 2, 2))
  mask = np.ones((1, 2, 2, 2), bool)
  mask[0, 0, 0] = False
  results = _fully_masked_rows(z, m, c, q, k, v, bias, mask, ct)
  for dtype in (F32, BF16):
    probs, grad = results[np.dtype(dtype).name]
    assert probs.dtype == dtype and grad.dtype == dtype
    # Flax's convention for the output (uniform); the gradient is 0, as in Flax and JAX.
    # Uniform: exp(0 - log 3), within one ulp of 1/3 (one rounding in the output dtype).
    np.testing.assert_allclose(
      np.asarray(probs[0], F32), np.asarray(np.full(3, 1 / 3, dtype), F32),
      rtol=float(jnp.finfo(dtype).eps), atol=0,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(grad[0], F32), 0.0)
    # The other row is untouched: p = (1 - s, 0, s), dz = p (c - <c, p>).
    ref = results["jax"]
    assert ref[1, 0] != 0 and ref[1, 1] == 0
    rtol = 2**-7 if dtype == BF16 else 1e-6
    np.testing.assert_allclose(np.asarray(grad[1], F32), ref[1], rtol=rtol, atol=1e-7)
  dq, _, dbias = results["ours"]
  np.testing.assert_array_equal(dq[0, 0, 0], 0.0)  # the query with no key, first head
  np.testing.assert_array_equal(dbias[0, 0, 0], 0.0)
  assert (np.abs(dq[0, 0, 1]) > 0).all()  # the same query in the other head
  for o, r in zip(results["ours"], results["flax"], strict=True):
    np.testing.assert_allclose(o, r, **FP32_TOL)


def test_softmax_rejects_a_mask_that_does_not_broadcast_to_the_logits():
  x = jnp.zeros((2, 3))
  for shape in [(2, 4), (1, 2, 3), (3, 1)]:
    with pytest.raises(ValueError, match=r"where must broadcast to the logits' shape \(2, 3\)"):
      jlf.softmax(x, where=jnp.ones(shape, bool))


# --------------------------------------------------------------------------------------------
# softmax against jax.nn.softmax


def _softmax_variants(x, ct, full, row, column, full0):
  """Ours and the references for each static variant: (name, axis, mask)."""
  variants = [
    ("none", -1, None),
    ("full", -1, full),  # fully masked rows included
    ("padding", -1, row),  # [n]: one mask for every row
    ("rows", -1, column),  # [..., 1]: whole rows masked or kept
    ("axis0", 0, full0),
  ]
  results = {}
  for name, axis, where in variants:
    for dtype in (F32, BF16):
      xd = x.astype(dtype)
      loss = lambda f, axis=axis, where=where: lambda x: jnp.sum(f(x, axis, where).astype(F32) * ct)
      ours = jlf.softmax(xd, axis, where), jax.grad(loss(jlf.softmax))(xd)
      # The fp32 references, at the (rounded) logits the 16-bit softmax sees.
      xf = xd.astype(F32)
      jax_ref = lambda x, axis, where: jax.nn.softmax(x, axis, where=where)
      refs = (
        _flax_softmax(xf, axis, where),
        jax_ref(xf, axis, where),
        jax.grad(loss(jax_ref))(xf),
      )
      live = (
        jnp.ones_like(xf, bool)
        if where is None
        else jnp.broadcast_to(jnp.any(where, axis, keepdims=True), xf.shape)
      )
      results[name, np.dtype(dtype).name] = (ours, refs, live)
  return results


@jit
def _softmax_diff(cases):
  return [_softmax_variants(*case) for case in cases]


SOFTMAX_SHAPES = [(3, 5), (2, 3, 1)]


def _softmax_case(draw, rng, shape):
  x, ct = 2 * _normal(rng, shape), _normal(rng, shape)
  full = _masked_out(draw, shape)
  row = np.array(draw(st.lists(st.booleans(), min_size=shape[-1], max_size=shape[-1])), bool)
  column = draw(st.lists(st.booleans(), min_size=shape[0], max_size=shape[0]))
  column = np.array(column, bool).reshape((shape[0],) + (1,) * (len(shape) - 1))
  full0 = np.moveaxis(_masked_out(draw, shape[1:] + shape[:1]), -1, 0)
  return x, ct, full, row, column, full0


@settings(max_examples=10, deadline=None)
@given(data=st.data(), seed=seeds)
def test_softmax_matches_jax(data, seed):
  rng = np.random.default_rng(seed)
  cases = [_softmax_case(data.draw, rng, shape) for shape in SOFTMAX_SHAPES]
  for case, results in zip(cases, _softmax_diff(cases), strict=True):
    ct = case[1]
    for (name, dtype), ((out, grad), (flax_out, jax_out, jax_grad), live) in results.items():
      live = np.asarray(live)
      msg = f"variant {name}, {dtype}, shape {ct.shape}"
      assert out.dtype == dtype and grad.dtype == dtype, msg
      out, grad = np.asarray(out, F32), np.asarray(grad, F32)
      # Masked rows' gradients are exactly 0, as with jax.nn.softmax(where=) and Flax.
      np.testing.assert_array_equal(grad[~live], 0.0, err_msg=msg)
      np.testing.assert_array_equal(np.asarray(jax_grad)[~live], 0.0, err_msg=msg)
      if dtype == "float32":
        # The output is Flax's (uniform where fully masked), jax.nn.softmax's elsewhere.
        np.testing.assert_allclose(out, flax_out, **FP32_TOL, err_msg=msg)
        np.testing.assert_allclose(out[live], np.asarray(jax_out)[live], **FP32_TOL, err_msg=msg)
        np.testing.assert_allclose(grad, jax_grad, **FP32_TOL, err_msg=msg)
      else:  # fp32 inside, rounded once; the backward pass from the 16-bit probabilities
        want = np.asarray(np.asarray(flax_out).astype(BF16), F32)
        np.testing.assert_array_equal(out, want, err_msg=msg)
        # |dz| <= |dp| max: a few bf16 roundings (2^-9) of p, the cotangent and the result.
        atol = 2**-6 * float(np.abs(ct).max())
        np.testing.assert_allclose(grad, jax_grad, rtol=2**-6, atol=atol, err_msg=msg)


# --------------------------------------------------------------------------------------------
# dot_product_attention against flax.linen.dot_product_attention

# (mask kind, is_causal, dropout (rate, broadcast) or None, bias): the static variants; together
# they cover no mask and each kind of mask, causal masking, both dropout layouts and a bias.
ATTENTION_VARIANTS = (
  (None, False, None, False),
  ("padding", True, (0.3, True), True),  # [batch, 1, 1, kv]
  ("full", False, (0.5, False), True),  # [batch, heads, q, kv], fully masked rows included
  ("rows", True, None, False),  # [batch, 1, q, 1]: whole rows masked
)
# (batch, q_len, kv_len, heads, kv_heads, depth)
ATTENTION_SHAPES = [(2, 3, 4, 2, 2, 4), (1, 1, 3, 4, 2, 2)]


def _causal(q_len, kv_len):
  return jnp.tril(jnp.ones((q_len, kv_len), bool))


def _attention_variants(q, k, v, bias, masks, ct, dropout_rng):
  groups = q.shape[-2] // k.shape[-2]
  results = []
  for kind, causal, dropout, with_bias in ATTENTION_VARIANTS:
    mask = None if kind is None else masks[kind]
    rate, broadcast = dropout or (0.0, True)
    kwargs = dict(
      dropout_rng=dropout_rng, dropout_rate=rate, broadcast_dropout=broadcast, deterministic=False
    )

    def ours(q, k, v, b, mask=mask, causal=causal, kwargs=kwargs):
      return jlf.dot_product_attention(q, k, v, bias=b, mask=mask, is_causal=causal, **kwargs)

    def ref(q, k, v, b, mask=mask, causal=causal, kwargs=kwargs):
      if causal:  # linen has no is_causal: the same tril mask, combined
        tril = _causal(q.shape[-3], k.shape[-3])
        mask = tril if mask is None else mask & tril
      # Grouped-query attention is ordinary attention with each key/value head repeated.
      k, v = jnp.repeat(k, groups, -2), jnp.repeat(v, groups, -2)
      return nn.dot_product_attention(q, k, v, bias=b, mask=mask, **kwargs)

    b = bias if with_bias else None
    operands = (q, k, v, b)
    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    results.append(
      (
        (ours(*operands), jax.grad(loss(ours), argnums)(*operands)),
        (ref(*operands), jax.grad(loss(ref), argnums)(*operands)),
      )
    )
  return results


@jit
def _attention_diff(cases):
  return [_attention_variants(*case) for case in cases]


def _attention_case(draw, rng, shape):
  batch, q_len, kv_len, heads, kv_heads, depth = shape
  q, ct = _normal(rng, (batch, q_len, heads, depth)), _normal(rng, (batch, q_len, heads, depth))
  k, v = (_normal(rng, (batch, kv_len, kv_heads, depth)) for _ in range(2))
  bias = _normal(rng, (1, heads, q_len, kv_len))
  padding = draw(st.lists(st.booleans(), min_size=batch * kv_len, max_size=batch * kv_len))
  rows = draw(st.lists(st.booleans(), min_size=batch * q_len, max_size=batch * q_len))
  masks = {
    # A sequence that is all padding has only fully masked rows.
    "padding": np.array(padding, bool).reshape(batch, 1, 1, kv_len),
    "full": _masked_out(draw, (batch, heads, q_len, kv_len)),
    "rows": np.array(rows, bool).reshape(batch, 1, q_len, 1),
  }
  return q, k, v, bias, masks, ct, jax.random.key(int(rng.integers(2**31)))


@settings(max_examples=10, deadline=None)
@given(data=st.data(), seed=seeds)
def test_dot_product_attention_matches_flax(data, seed):
  rng = np.random.default_rng(seed)
  cases = [_attention_case(data.draw, rng, shape) for shape in ATTENTION_SHAPES]
  for shape, results in zip(ATTENTION_SHAPES, _attention_diff(cases), strict=True):
    for variant, ((out, grads), (ref_out, ref_grads)) in zip(
      ATTENTION_VARIANTS, results, strict=True
    ):
      msg = f"variant {variant}, shape {shape}"
      np.testing.assert_allclose(out, ref_out, **FP32_TOL, err_msg=msg)
      for name, g, r in zip("qkvb", grads, ref_grads, strict=False):
        np.testing.assert_allclose(g, r, **FP32_TOL, err_msg=f"{msg}, d{name}")


# (dtype, broadcast_dropout, kv_heads)
DROPOUT_CASES = [(F32, True, 2), (BF16, True, 2), (F32, False, 1), (BF16, False, 1)]


@jit
def _dropped_out(q, k, v, dropout_rng):
  results = []
  for dtype, broadcast, kv_heads in DROPOUT_CASES:
    kwargs = dict(
      dropout_rng=dropout_rng, dropout_rate=0.4, broadcast_dropout=broadcast, deterministic=False
    )
    ops = [x.astype(dtype) for x in (q, k[..., :kv_heads, :], v[..., :kv_heads, :])]
    ours = jlf.dot_product_attention(*ops, **kwargs)
    # The fp32 reference at the same (rounded) inputs; repeated key/value heads for GQA.
    groups = q.shape[-2] // kv_heads
    q32, k32, v32 = (x.astype(F32) for x in ops)
    k32, v32 = jnp.repeat(k32, groups, -2), jnp.repeat(v32, groups, -2)
    results.append((ours, nn.dot_product_attention(q32, k32, v32, **kwargs)))
  return results


def test_attention_dropout_drops_what_flax_drops():
  # With one-hot values the output is the dropped-out attention weights themselves,
  # out[b, q, h, j] = weights[b, h, q, j]. The same key gives the same bernoulli draw
  # (same shape, same rate), so the zeros must coincide, in 16 bits too.
  batch, length, heads = 2, 6, 2
  rng = np.random.default_rng(0)
  q, k = _normal(rng, (batch, length, heads, 4)), _normal(rng, (batch, length, heads, 4))
  v = np.broadcast_to(np.eye(length, dtype=F32)[None, :, None, :], (batch, length, heads, length))
  results = _dropped_out(q, k, v, jax.random.key(3))
  for (dtype, broadcast, kv_heads), (ours, ref) in zip(DROPOUT_CASES, results, strict=True):
    msg = f"{dtype.name}, broadcast_dropout={broadcast}, {kv_heads} key/value heads"
    assert ours.dtype == dtype, msg
    ours, dropped = np.asarray(ours, F32), np.asarray(ref) == 0
    np.testing.assert_array_equal(ours == 0, dropped, err_msg=msg)
    assert 0.2 < dropped.mean() < 0.6, msg  # the test sees both kept and dropped weights
    # broadcast_dropout: one pattern for every batch element and head.
    assert (dropped == dropped[:1, :, :1]).all() == broadcast, msg
    tol = 1e-5 if dtype == F32 else 2**-7
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol, err_msg=msg)


# --------------------------------------------------------------------------------------------
# dot_general, conv_general_dilated, einsum against lax / jnp


def _operands(rng, shapes, dtype):
  """fp32: normal values. 16-bit: small integers, so every product and sum is exact in fp32."""
  if np.dtype(dtype) == F32:
    return tuple(_normal(rng, s) for s in shapes)
  return tuple(rng.integers(-2, 3, s).astype(dtype) for s in shapes)


@st.composite
def dot_problems(draw):
  """A dot_general: shapes and dimension numbers, dimensions in any order."""
  size = st.sampled_from([1, 2, 3])
  counts = {
    "b": draw(st.integers(0, 1)),
    "c": draw(st.integers(0, 2)),
    "l": draw(st.integers(0, 2)),
    "r": draw(st.integers(0, 1)),
  }
  sizes = {(kind, i): draw(size) for kind, n in counts.items() for i in range(n)}
  lhs = draw(st.permutations([d for d in sizes if d[0] in "bcl"]))
  rhs = draw(st.permutations([d for d in sizes if d[0] in "bcr"]))
  pick = lambda labels, kind: tuple(labels.index((kind, i)) for i in range(counts[kind]))
  dims = ((pick(lhs, "c"), pick(rhs, "c")), (pick(lhs, "b"), pick(rhs, "b")))
  return ("dot", dims), (tuple(sizes[d] for d in lhs), tuple(sizes[d] for d in rhs))


@st.composite
def conv_problems(draw):
  """A 1-D or 2-D conv_general_dilated in NCHW or NHWC layout, with a valid output."""
  ndim = draw(st.sampled_from([1, 2]))
  group_kind = draw(st.sampled_from(["feature", "batch"]))
  groups = draw(st.sampled_from([1, 2]))
  batch = draw(st.sampled_from([1, 2])) * (groups if group_kind == "batch" else 1)
  in_features = draw(st.sampled_from([1, 2])) * (groups if group_kind == "feature" else 1)
  out_features = draw(st.sampled_from([1, 2])) * groups
  spatial = tuple(draw(st.integers(3, 6)) for _ in range(ndim))
  kernel = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
  lhs_dilation = tuple(draw(st.sampled_from([1, 2])) for _ in range(ndim))
  rhs_dilation = tuple(draw(st.sampled_from([1, 2])) for _ in range(ndim))
  explicit = st.tuples(st.integers(0, 1), st.integers(0, 1))
  if any(d > 1 for d in lhs_dilation):  # string paddings are for undilated inputs
    padding = tuple(draw(explicit) for _ in range(ndim))
  else:
    padding = draw(st.sampled_from(["VALID", "SAME"]) | st.tuples(*[explicit] * ndim))
  # Keep the (dilated) kernel within the (dilated, padded) input: a non-empty output.
  dilated = zip(spatial, kernel, lhs_dilation, rhs_dilation, strict=True)
  for n, (s, k, ld, rd) in enumerate(dilated):
    pad = sum(padding[n]) if isinstance(padding, tuple) else 0
    assume((s - 1) * ld + 1 + pad >= (k - 1) * rd + 1)
  kwargs = dict(
    window_strides=tuple(draw(st.sampled_from([1, 2])) for _ in range(ndim)),
    padding=padding,
    lhs_dilation=lhs_dilation,
    rhs_dilation=rhs_dilation,
    feature_group_count=groups if group_kind == "feature" else 1,
    batch_group_count=groups if group_kind == "batch" else 1,
  )
  in_per_group = in_features // kwargs["feature_group_count"]
  if draw(st.booleans()):  # channels last
    letters = "HW" if ndim == 2 else "W"
    kwargs["dimension_numbers"] = (f"N{letters}C", f"{letters}IO", f"N{letters}C")
    shapes = (batch, *spatial, in_features), (*kernel, in_per_group, out_features)
  else:  # lax's default: NCHW, OIHW
    shapes = (batch, in_features, *spatial), (out_features, in_per_group, *kernel)
  return ("conv", tuple(sorted(kwargs.items()))), shapes


EINSUMS = [
  "ij,jk->ik",
  "bij,bkj->bki",
  "...qhd,...khd->...hqk",
  "...hqk,...khd->...qhd",
  "ij,ij->",
  "i,j->ij",
  "ijk,jkl->li",
  "ij,jk,kl->il",
]


@st.composite
def einsum_problems(draw):
  """An einsum from EINSUMS with drawn dimension sizes (and leading batch dimensions)."""
  subscripts = draw(st.sampled_from(EINSUMS))
  size = {c: draw(st.sampled_from([1, 2, 3])) for c in "ijklbqhd"}
  batch = tuple(draw(st.lists(st.sampled_from([1, 2]), max_size=2)))
  shapes = tuple(
    (*batch, *(size[c] for c in s[3:])) if s.startswith("...") else tuple(size[c] for c in s)
    for s in subscripts.split("->")[0].split(",")
  )
  return ("einsum", subscripts), shapes


def _kernels(problem):
  """jmp_lite's kernel and JAX's for a (kind, static arguments) problem."""
  kind, spec = problem
  if kind == "dot":
    return (
      lambda a, b: jlf.dot_general(a, b, spec),
      lambda a, b: lax.dot_general(a, b, spec),
    )
  if kind == "conv":
    kwargs = dict(spec)
    return (
      lambda a, b: jlf.conv_general_dilated(a, b, **kwargs),
      lambda a, b: lax.conv_general_dilated(a, b, **kwargs),
    )
  return (lambda *ops: jlf.einsum(spec, *ops), lambda *ops: jnp.einsum(spec, *ops))


@functools.partial(jit, static_argnames="problems")
def _kernels_diff(operands, cts, problems):
  """Per problem: output and operand gradients of jmp_lite's kernel (in the operands' dtype)
  and of JAX's (in fp32, then cast to that dtype)."""
  results = []
  for problem, ops, ct in zip(problems, operands, cts, strict=True):
    ours, ref = _kernels(problem)
    out, vjp = jax.vjp(ours, *ops)
    ref_out, ref_vjp = jax.vjp(ref, *(x.astype(F32) for x in ops))
    dtype = ops[0].dtype
    ref_grads = [g.astype(dtype) for g in ref_vjp(ct.astype(F32))]
    results.append(((out, vjp(ct)), (ref_out.astype(dtype), ref_grads)))
  return results


@settings(max_examples=6, deadline=None)
@given(
  problems=st.tuples(dot_problems(), conv_problems(), einsum_problems()),
  dtypes=st.tuples(*[st.sampled_from([F32, BF16, F16])] * 3),
  seed=seeds,
)
def test_dot_general_conv_and_einsum_match_lax(problems, dtypes, seed):
  # fp32: jmp_lite passes the operands to lax, so every value is identical. 16-bit: small
  # integers, so the fp32 products and sums are exact and rounding once to 16 bits (ours:
  # fp32 accumulation) must give exactly the rounded fp32 result, forward and backward.
  rng = np.random.default_rng(seed)
  statics = tuple(problem for problem, _ in problems)
  operands = tuple(
    _operands(rng, shapes, dtype) for (_, shapes), dtype in zip(problems, dtypes, strict=True)
  )
  cts = []
  for problem, ops, dtype in zip(statics, operands, dtypes, strict=True):
    out = jax.eval_shape(_kernels(problem)[1], *ops)
    cts.append(_operands(rng, [out.shape], dtype)[0])
  results = _kernels_diff(operands, tuple(cts), statics)
  for problem, ops, dtype, ((out, grads), (ref_out, ref_grads)) in zip(
    statics, operands, dtypes, results, strict=True
  ):
    msg = f"{problem} on {[x.shape for x in ops]}, {dtype.name}"
    assert out.dtype == dtype and len(grads) == len(ops), msg
    np.testing.assert_array_equal(np.asarray(out, F32), np.asarray(ref_out, F32), err_msg=msg)
    for g, r in zip(grads, ref_grads, strict=True):
      assert g.dtype == dtype, msg
      np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(r, F32), err_msg=msg)


# --------------------------------------------------------------------------------------------
# Flax modules through policy_apply (bf16 compute) against plain Flax in fp32


class _Around(nn.Module):
  """``layer`` between two ``nn.Dense`` layers, so that it sees and returns bf16 activations
  (and every model checks Dense, whose ``dot_general`` the policy replaces, too)."""

  layer: nn.Module
  features: int = 8
  bias_before: bool = True

  @nn.compact
  def __call__(self, x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = nn.Dense(self.features, use_bias=self.bias_before)(x)
    return nn.Dense(3)(self.layer(x))


# name: (model, input shape, input kind, mutable collections)
MODULES = {
  "LayerNorm": (_Around(nn.LayerNorm()), (2, 3, 5), "float", ()),
  "RMSNorm": (_Around(nn.RMSNorm()), (2, 3, 5), "float", ()),
  "GroupNorm": (_Around(nn.GroupNorm(num_groups=2)), (2, 3, 5), "float", ()),
  # Train mode: batch statistics; a bias before it would get an exact zero gradient.
  "BatchNorm": (
    _Around(nn.BatchNorm(use_running_average=False, momentum=0.9), bias_before=False),
    (3, 2, 5),
    "float",
    ("batch_stats",),
  ),
  "Embed": (_Around(nn.Embed(6, 8)), (2, 7), "tokens", ()),
  "Conv": (_Around(nn.Conv(4, (3, 3), strides=(2, 1))), (2, 5, 4, 3), "float", ()),
}


def _host_variables(rng, model, *args):
  """Random variables with ``model.init``'s structure, made on the host.

  Compiling ``init`` (its random number generation) would cost as much as the test itself.
  Kernels get a fan-in scaling (the product of all but their last dimension), embeddings
  unit normal values, scales and variances ``1 + N(0, 0.01)``, biases and means ``N(0, 0.01)``.
  """
  shapes = jax.eval_shape(functools.partial(model.init, jax.random.key(0)), *args)

  def fill(path, leaf):
    name = path[-1].key
    if name in ("kernel", "embedding"):
      fan_in = int(np.prod(leaf.shape[:-1])) if name == "kernel" else 1
      return _normal(rng, leaf.shape) / np.float32(np.sqrt(fan_in))
    offset = 1 if name in ("scale", "var") else 0
    return (offset + 0.1 * _normal(rng, leaf.shape)).astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def _cotangent(rng, shape):
  """The output cotangent: 1 + N(0, 1).

  Bias gradients are sums over positions; with a zero-mean cotangent they cancel, and a
  relative error then measures the cancellation (and JAX's 16-bit sum in the transpose of
  the bias broadcast, which is not jmp_lite's) more than the policy.
  """
  return 1 + _normal(rng, shape)


@functools.cache
def _output_shape(name):
  model, shape, kind, _ = MODULES[name]
  x = jax.ShapeDtypeStruct(shape, jnp.int32 if kind == "tokens" else F32)
  out, _ = jax.eval_shape(functools.partial(model.init_with_output, jax.random.key(0)), x)
  return out.shape


@jit
def _modules_diff(variables, inputs, cts):
  """Per module: (gradients, (output, updated state)) under the policy and in plain Flax."""
  results = {}
  for name, (model, _, _, mutable) in MODULES.items():
    x, ct, v = inputs[name], cts[name], variables[name]
    pair = []
    for apply in (jlf.policy_apply(model, POLICY), model.apply):

      def loss(params, x, apply=apply, v=v, mutable=mutable, ct=ct):
        out = apply({**v, "params": params}, x, mutable=list(mutable) or False)
        out, state = out if mutable else (out, {})
        return jnp.sum(out.astype(F32) * ct), (out, state)

      argnums = (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0
      pair.append(jax.grad(loss, argnums, has_aux=True)(v["params"], x))
    results[name] = pair
  return results


@settings(max_examples=4, deadline=None)
@given(seed=seeds, scale=st.sampled_from([0.5, 2.0]))
def test_policy_apply_modules_match_fp32_flax(seed, scale):
  rng = np.random.default_rng(seed)
  inputs, cts, variables = {}, {}, {}
  for name, (model, shape, kind, _) in MODULES.items():
    if kind == "tokens":  # few distinct tokens: the scatter-add adds many rows into each
      inputs[name] = rng.integers(0, 3, shape).astype(np.int32)
    else:
      inputs[name] = scale * _normal(rng, shape)
    cts[name] = _cotangent(rng, _output_shape(name))
    variables[name] = _host_variables(rng, model, inputs[name])
  results = _modules_diff(variables, inputs, cts)
  for name, ((grads, (out, state)), (ref_grads, (ref_out, ref_state))) in results.items():
    assert out.dtype == F32 and {g.dtype for g in jax.tree.leaves(grads)} == {F32}, name
    errors = leaf_rel_errors((grads, out, state), (ref_grads, ref_out, ref_state))
    # Compared: every parameter's gradient, the input's (floating inputs), the output and
    # every updated statistic.
    _, _, kind, mutable = MODULES[name]
    compared = [variables[name]["params"], *(variables[name][c] for c in mutable)]
    expected = len(jax.tree.leaves(compared)) + (kind == "float") + 1
    assert len(errors) == expected, (name, errors)
    assert max(errors.values()) <= 0.05, (name, errors)
  (_, (_, state)), _ = results["BatchNorm"]
  assert set(state["batch_stats"]["layer"]) == {"mean", "var"}


class _SelfAttention(nn.Module):
  dropout_rate: float = 0.0
  broadcast_dropout: bool = True

  @nn.compact
  def __call__(self, x, mask):
    attention = nn.MultiHeadDotProductAttention(
      num_heads=2,
      qkv_features=8,
      dropout_rate=self.dropout_rate,
      broadcast_dropout=self.broadcast_dropout,
    )
    return attention(x, x, mask=mask, deterministic=False)


# (mask kind, dropout rate, broadcast dropout)
ATTENTION_MODULE_VARIANTS = (
  ("padding", 0.0, True),
  ("causal", 0.3, True),
  ("full", 0.3, False),
)
ATTENTION_MODULE_SHAPE = (2, 8, 8)  # batch, length, features


def _attention_module_run(variables, x, masks, ct, dropout_rng):
  results = []
  for kind, rate, broadcast in ATTENTION_MODULE_VARIANTS:
    model = _SelfAttention(rate, broadcast)
    pair = []
    for apply in (jlf.policy_apply(model, POLICY), model.apply):

      def loss(params, x, apply=apply, mask=masks[kind]):
        out = apply({"params": params}, x, mask, rngs={"dropout": dropout_rng})
        return jnp.sum(out.astype(F32) * ct)

      pair.append(jax.grad(loss, (0, 1))(variables["params"], x))
    results.append(pair)
  return results


_attention_module_diff = jit(_attention_module_run)
_KEY_BIAS = "[0]['MultiHeadDotProductAttention_0']['key']['bias']"


def _attention_errors(grads, ref_grads):
  """leaf_rel_errors without the key bias, whose gradient is 0 but for rounding.

  The key bias adds the same q.b to a whole row of logits, which the softmax ignores, so its
  gradient is rounding noise (in fp32 too) and no relative error applies to it.
  """
  errors = leaf_rel_errors(grads, ref_grads)
  del errors[_KEY_BIAS]
  return errors


@settings(max_examples=6, deadline=None)
@given(data=st.data(), seed=seeds)
def test_policy_apply_attention_matches_fp32_flax(data, seed):
  batch, length, _ = ATTENTION_MODULE_SHAPE
  rng = np.random.default_rng(seed)
  # Moderate logits: saturated rows (p nearly one-hot) leave query and key gradients that
  # are mostly cancellation, where any rounding, even fp32's, is a large relative error.
  x, ct = _normal(rng, ATTENTION_MODULE_SHAPE), _cotangent(rng, ATTENTION_MODULE_SHAPE)
  variables = _host_variables(rng, _SelfAttention(), x, None)
  padding = data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length))
  padding = np.array(padding, bool).reshape(batch, length)  # may pad a whole sequence
  masks = {
    "padding": padding[:, None, None, :],  # [batch, 1, 1, length]
    "causal": nn.combine_masks(  # [batch, 1, length, length]
      nn.make_causal_mask(padding), nn.make_attention_mask(padding, padding)
    ),
    "full": _masked_out(data.draw, (batch, 2, length, length)),
  }
  key = jax.random.key(seed)
  results = _attention_module_diff(variables, x, masks, ct, key)
  for variant, (grads, ref_grads) in zip(ATTENTION_MODULE_VARIANTS, results, strict=True):
    errors = _attention_errors(grads, ref_grads)
    assert len(errors) == 8, errors  # q, k, v, out: kernels and biases (but k's); the input
    assert max(errors.values()) <= 0.05, (variant, errors)
    # The key bias gradient: small next to the key kernel's, made from the same key gradients.
    key_grads = [g["MultiHeadDotProductAttention_0"]["key"] for g in (grads[0], ref_grads[0])]
    bias_norm = np.linalg.norm(key_grads[0]["bias"])
    assert bias_norm <= 0.05 * np.linalg.norm(key_grads[1]["kernel"]), (variant, bias_norm)
  # Dropout with another key is far off: the tolerance would catch a different dropout pattern.
  other = _attention_module_diff(variables, x, masks, ct, jax.random.key(seed + 1))
  for (kind, rate, _), (grads, _), (_, ref_grads) in zip(
    ATTENTION_MODULE_VARIANTS, results, other, strict=True
  ):
    if rate > 0:
      assert max(_attention_errors(grads, ref_grads).values()) > 0.2, kind


# --------------------------------------------------------------------------------------------
# grad_reduction_dtype=float32 on the transformer LM: runs on XLA:CPU (its kernel gradients are
# products XLA:CPU cannot run on 16-bit operands) and changes no value beyond bf16 rounding.


@jit
def _lm_steps(params, toks):
  """Loss and gradients: the policy with fp32 gradient reduction, without it, plain fp32 Flax."""
  model = LinenLM()
  applies = (
    jlf.policy_apply(model, jlf.ModulePolicies(POLICY, grad_reduction_dtype=F32)),
    jlf.policy_apply(model, POLICY),
    model.apply,
  )
  step = lambda apply: jax.value_and_grad(lambda p: lm_loss(apply({"params": p}, toks), toks))
  return [step(apply)(params) for apply in applies]


def test_policy_apply_with_fp32_gradient_reduction_runs_the_lm_on_cpu():
  toks = tokens()
  params = _host_variables(np.random.default_rng(0), LinenLM(), toks)["params"]
  (loss, grads), (ref_loss, ref_grads), (fp32_loss, fp32_grads) = _lm_steps(params, toks)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
  # The forward pass is the same program; the gradients differ by the rounding of
  # intermediates wherever XLA fuses the two backward passes differently.
  np.testing.assert_allclose(loss, ref_loss, rtol=2**-8)
  errors = leaf_rel_errors(grads, ref_grads)
  assert max(errors.values()) <= 2**-7, errors
  # Against fp32 Flax, as the modules above: the key bias's gradient is rounding noise
  # (see _attention_errors).
  for ours in (grads, ref_grads):
    errors = leaf_rel_errors(ours, fp32_grads)
    del errors["['LinenBlock_0']['MultiHeadDotProductAttention_0']['key']['bias']"]
    assert max(errors.values()) <= 0.05, errors
  np.testing.assert_allclose(loss, fp32_loss, rtol=0.01)
