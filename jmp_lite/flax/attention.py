"""Attention whose softmax runs in fp32 and keeps only 16-bit residuals.

The softmax is the precision-sensitive step of attention: ``exp`` of logits
near bf16's coarse spacing (``2^-7`` relative) and a sum over the key length
that bf16 would round at every step. :func:`softmax` therefore computes

.. math::

  p = \\mathrm{round}_{16}\\big(\\mathrm{softmax}(\\mathrm{fp32}(z))\\big)

in fp32 and rounds only its result. Its backward pass,
:math:`\\bar z = p \\odot (\\bar p - \\langle \\bar p, p \\rangle)`, is also
computed in fp32, from the 16-bit ``p``: storing ``p`` in fp32 would make the
attention probabilities, the largest activation of a transformer, cost as
much memory as in an fp32 model (JAX's ``softmax`` keeps its fp32 output as
the residual, and ``p`` is saved again in 16 bits for the ``p @ v`` matmul).

:func:`dot_product_attention` is a drop-in ``attention_fn`` for Flax's linen
``MultiHeadDotProductAttention`` and NNX ``MultiHeadAttention``: it accepts
the keyword arguments either passes, computes both matmuls with
:func:`~jmp_lite.flax.accumulate.einsum` (fp32 accumulation) and the softmax
with :func:`softmax`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_lite.flax import accumulate


def softmax(logits: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
  """Softmax computed in fp32, returned (and saved for backward) in ``logits.dtype``.

  Args:
    logits: the scores; for fp32 (or wider) logits this is :func:`jax.nn.softmax`.
    axis: the axis to normalize over.
    where: an optional boolean mask broadcastable to ``logits``; masked-out
      entries get probability 0 (a fully masked row is uniform, as with Flax's
      ``finfo.min`` masking). Applying it here rather than with ``jnp.where``
      on the logits keeps neither the mask nor the masked logits as residuals.

  Reverse-mode differentiable; not forward-mode (a :func:`jax.custom_vjp`).
  """
  if where is not None:
    where = jnp.asarray(where, jnp.bool_)
  return _softmax(logits, where, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(logits, where, axis):
  compute = jnp.promote_types(logits.dtype, jnp.float32)
  x = logits.astype(compute)
  if where is not None:
    x = jnp.where(where, x, jnp.finfo(compute).min)
  return jax.nn.softmax(x, axis=axis).astype(logits.dtype)


def _softmax_fwd(logits, where, axis):
  probs = _softmax(logits, where, axis)
  return probs, probs


def _softmax_bwd(axis, probs, cotangent):
  # dz = p * (dp - <dp, p>); masked entries have p = 0 and get no gradient.
  compute = jnp.promote_types(probs.dtype, jnp.float32)
  p, g = probs.astype(compute), cotangent.astype(compute)
  grad = p * (g - jnp.sum(g * p, axis=axis, keepdims=True))
  return grad.astype(probs.dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _sow_weights(module: Any, weights: jax.Array) -> None:
  if isinstance(module, nnx.Module):
    module.sow(nnx.Intermediate, "attention_weights", weights)
  else:
    module.sow("intermediates", "attention_weights", weights)


def dot_product_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  broadcast_dropout: bool = True,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype: Any = None,
  precision: Any = None,
  module: Any = None,
  force_fp32_for_softmax: bool = False,
  einsum_dot_general: Callable[..., jax.Array] | None = None,
  qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
  attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
  promote_dtype: Callable[..., Any] | None = None,
  is_causal: bool = False,
) -> jax.Array:
  """Scaled dot-product attention with an fp32 softmax and fp32 accumulation.

  .. math::

    \\mathrm{out} = \\mathrm{softmax}_{32}\\Big(\\frac{q k^\\top}{\\sqrt d} + b,
    \\ \\mathrm{mask}\\Big)\\, v

  Shapes follow Flax: ``query`` ``[batch..., q_len, heads, depth]``, ``key``
  and ``value`` ``[batch..., kv_len, kv_heads, depth]`` (``kv_heads`` may
  divide ``heads``: grouped-query attention), ``bias``/``mask`` broadcastable
  to ``[batch..., heads, q_len, kv_len]``. The result has ``query``'s shape and
  the (promoted) input dtype.

  Args:
    query, key, value, bias, mask: as in :func:`flax.linen.dot_product_attention`
      and :func:`flax.nnx.dot_product_attention`, as are ``broadcast_dropout``,
      ``dropout_rng``, ``dropout_rate``, ``deterministic``, ``dtype``,
      ``precision``, ``module`` and ``is_causal``.
    force_fp32_for_softmax: ignored: the softmax is always computed in fp32
      (linen's attention module passes its own default, ``False``; swapping
      this function in is how a policy asks for fp32).
    einsum_dot_general: a ``dot_general`` for both matmuls (default
      :func:`jmp_lite.flax.dot_general`).
    qk_attn_weights_einsum, attn_weights_value_einsum: einsums for the two
      matmuls (e.g. quantized ones); they replace the fp32-accumulating default.
    promote_dtype: NNX's dtype promotion hook, ``promote_dtype((q, k, v),
      dtype=dtype)``; by default the three are cast to ``dtype`` or to their
      common type.
  """
  del force_fp32_for_softmax  # Flax's modules pass False by default; fp32 is the point here.
  if (qk_attn_weights_einsum is None) != (attn_weights_value_einsum is None):
    raise ValueError(
      "qk_attn_weights_einsum and attn_weights_value_einsum must be given together, got "
      f"{qk_attn_weights_einsum!r} and {attn_weights_value_einsum!r}."
    )
  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  else:
    dtype = dtype or jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  dtype = query.dtype
  if query.ndim != key.ndim or key.ndim != value.ndim or query.ndim < 3:
    raise ValueError(
      "query, key and value must have the same rank >= 3 ([batch..., length, heads, depth]), "
      f"got shapes {query.shape}, {key.shape} and {value.shape}."
    )
  heads, kv_heads = query.shape[-2], key.shape[-2]
  if heads % kv_heads or value.shape[-2] != kv_heads:
    raise ValueError(
      f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}, "
      f"{value.shape[-2]}), which must match."
    )

  qk_einsum: Callable[..., jax.Array]
  pv_einsum: Callable[..., jax.Array]
  if qk_attn_weights_einsum is None or attn_weights_value_einsum is None:  # both, see above
    dot = einsum_dot_general or accumulate.dot_general
    qk_einsum = functools.partial(jnp.einsum, precision=precision, _dot_general=dot)
    pv_einsum = qk_einsum
  else:
    qk_einsum, pv_einsum = qk_attn_weights_einsum, attn_weights_value_einsum

  groups = heads // kv_heads
  scale = jnp.sqrt(query.shape[-1]).astype(dtype)
  if groups == 1:
    logits = qk_einsum("...qhd,...khd->...hqk", query / scale, key)
  else:  # grouped-query attention: view the query heads as [kv_heads, groups]
    q = query.reshape((*query.shape[:-2], kv_heads, groups, query.shape[-1]))
    logits = qk_einsum("...qhgd,...khd->...hgqk", q / scale, key)
    logits = logits.reshape((*logits.shape[:-4], heads, *logits.shape[-2:]))
  if bias is not None:
    logits = logits + jnp.asarray(bias, dtype)
  masks = [] if mask is None else [jnp.asarray(mask, jnp.bool_)]
  if is_causal:
    q_len, kv_len = logits.shape[-2:]
    masks.append(jnp.tril(jnp.ones((q_len, kv_len), jnp.bool_)))
  where = None
  for m in masks:
    where = m if where is None else where & m
  weights = softmax(logits, -1, where)
  if module is not None:
    _sow_weights(module, weights)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    if broadcast_dropout:
      # One mask shared by the batch and head dimensions, as in Flax.
      shape = (1,) * (weights.ndim - 2) + weights.shape[-2:]
    else:
      shape = weights.shape
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)  # type: ignore[arg-type]
    weights = weights * (keep.astype(dtype) / np.asarray(keep_prob, dtype))
  if groups == 1:
    return pv_einsum("...hqk,...khd->...qhd", weights, value)
  weights = weights.reshape((*weights.shape[:-3], kv_heads, groups, *weights.shape[-2:]))
  out = pv_einsum("...hgqk,...khd->...qhgd", weights, value)
  return out.reshape((*out.shape[:-3], heads, out.shape[-1]))
