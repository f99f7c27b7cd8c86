r"""Attention whose softmax runs in fp32 and keeps only 16-bit residuals.

The softmax is the precision-sensitive step of attention: ``exp`` of logits
near bf16's coarse spacing (``2^-7`` relative) and a sum over the key length
that bf16 would round at every step. :func:`softmax` therefore computes

.. math::

  p = \mathrm{round}_{16}\big(\mathrm{softmax}(\mathrm{fp32}(z))\big)

in fp32 and rounds only its result. Its backward pass,
:math:`\bar z = p \odot (\bar p - \langle \bar p, p \rangle)`, is also
computed in fp32, from the 16-bit ``p``: storing ``p`` in fp32 would make the
attention probabilities, the largest activation of a transformer, cost as
much memory as in an fp32 model (JAX's ``softmax`` keeps its fp32 output as
the residual, and ``p`` is saved again in 16 bits for the ``p @ v`` matmul).

A mask ``m`` (``where=``) is applied inside the softmax, as Flax's attention
does: :math:`p = \mathrm{softmax}(\mathrm{where}(m, z, \mathrm{finfo.min}))`.
Masked-out entries get probability 0; a row with every entry masked is uniform
(``1/n`` to one rounding, Flax's ``dot_product_attention`` convention; :func:`jax.nn.softmax`
with ``where=`` returns 0 there instead) and, since it does not depend on the
logits, its gradient is 0, as in both. The backward formula is the derivative
with respect to the *masked* logits, so it is multiplied by ``m``: in a row
with an unmasked entry that changes nothing (masked ``p`` are 0), and a fully
masked row needs a flag saying so. Only that flag, the mask reduced over
``axis`` (one boolean per row), is saved, never the mask itself.

>>> m = jnp.array([[True, False, True], [False, False, False]])
>>> softmax(jnp.zeros((2, 3)), where=m)
Array([[0.5      , 0.       , 0.5      ],
       [0.3333333, 0.3333333, 0.3333333]], dtype=float32)
>>> jax.grad(lambda z: softmax(z, where=m) @ jnp.arange(3.0) @ jnp.ones(2))(jnp.zeros((2, 3)))
Array([[-0.5,  0. ,  0.5],
       [ 0. ,  0. ,  0. ]], dtype=float32)

:func:`dot_product_attention` is a drop-in ``attention_fn`` for Flax's linen
``MultiHeadDotProductAttention`` and NNX ``MultiHeadAttention``: it accepts
the keyword arguments either passes, computes both matmuls with
:func:`~jmp_lite.flax.einsum` (16-bit products) and the softmax
with :func:`softmax`. With its own einsums, no dropout and as many key as query
heads, the softmax and ``p @ v`` share one backward pass, which takes the row
sums :math:`\langle \bar p, p \rangle` as :math:`\langle \overline{out}, out \rangle`
(FlashAttention's :math:`D`) instead of reading ``p`` and :math:`\bar p` again.
With ``implementation="cudnn"`` the same attention runs by cuDNN's fused kernel
where the program is lowered for a GPU, and as above elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jmp_lite._validation import check_choice
from jmp_lite.flax import _accumulate as accumulate
from jmp_lite.flax import _fused_attention as fused_attention

_IMPLEMENTATIONS = ("xla", "cudnn")


def softmax(logits: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
  """Softmax computed in fp32, returned (and saved for backward) in ``logits.dtype``.

  Reverse-mode differentiable; not forward-mode (a :func:`jax.custom_vjp`).

  Args:
    logits: the scores; for fp32 (or wider) logits and no fully masked row this
      is :func:`jax.nn.softmax`.
    axis: the axis to normalize over.
    where: an optional boolean mask broadcastable to ``logits`` (without
      changing its shape); masked-out entries get probability 0. A fully
      masked row is uniform, as with Flax's ``finfo.min`` masking (not 0 as
      with :func:`jax.nn.softmax`), and its gradient is 0, as with both.
      Applying the mask here rather than with ``jnp.where`` on the logits
      keeps neither the mask nor the masked logits as residuals (only one
      boolean per row, whether it has an unmasked entry).

  Returns:
    The probabilities, of ``logits``' shape and dtype.

  Raises:
    ValueError: if ``where`` does not broadcast to ``logits``' shape.
  """
  return _softmax(logits, _checked_where(logits, where), axis)


def _checked_where(logits: jax.Array, where: jax.Array | None) -> jax.Array | None:
  """``where`` as a boolean array of the logits' rank, checked to broadcast to them."""
  if where is None:
    return None
  where = jnp.asarray(where, jnp.bool_)
  shape = np.shape(logits)
  try:
    broadcast = jnp.broadcast_shapes(where.shape, shape)
  except ValueError:
    broadcast = None
  if broadcast != shape:
    raise ValueError(f"where must broadcast to the logits' shape {shape}, got shape {where.shape}.")
  # Same rank as the logits, so that ``axis`` names the same dimension of both.
  return where.reshape((1,) * (len(shape) - where.ndim) + where.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(logits, where, axis):
  compute = jnp.promote_types(logits.dtype, jnp.float32)
  x = logits.astype(compute)
  if where is not None:
    x = jnp.where(where, x, jnp.finfo(compute).min)
  peak = jnp.max(x, axis=axis, keepdims=True)
  if compute == logits.dtype:
    # exp((x - peak) - log_total) exactly as jax.nn.softmax computes it. A fully masked row
    # is 0 - log(n): 1/n each.
    shifted = x - peak
    return jnp.exp(shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True)))
  probs = lax.platform_dependent(
    cpu=lambda: _by_log_total(x, peak, axis), default=lambda: _by_total(x, peak, axis)
  )
  # A fully masked row is 1/n each in both forms. Saying so with a select changes
  # no value, but XLA:TPU then fuses the softmax into fewer passes.
  if where is not None:
    probs = jnp.where(jnp.any(where, axis=axis, keepdims=True), probs, 1 / x.shape[axis])
  # The barrier makes the rounded probabilities the one array XLA keeps:
  # without it XLA recomputes them where they are used (the ``p @ v`` matmul,
  # the backward pass) and so keeps the logits alive until the backward pass,
  # and XLA:GPU writes the fp32 probabilities before rounding them.
  return lax.optimization_barrier(probs.astype(logits.dtype))


def _by_total(x: jax.Array, peak: jax.Array, axis: int) -> jax.Array:
  # exp(x - peak) / total: the form XLA:GPU's softmax rewriter fuses into one kernel
  # (one read of the logits, one 16-bit write), and with which XLA:TPU moves fewer
  # bytes (docs/benchmarks.md). Within an fp32 ulp of the log form, far below the
  # 16-bit rounding of the logits and of the result.
  unnormalized = jnp.exp(x - peak)
  return unnormalized / jnp.sum(unnormalized, axis=axis, keepdims=True)


def _by_log_total(x: jax.Array, peak: jax.Array, axis: int) -> jax.Array:
  # exp(x - (peak + log(total))) on XLA:CPU, where the division form's last bit depends
  # on how the rest of the program is fused: two programs computing the same values
  # (tests/test_examples.py::test_split_loses_no_update) then drift apart.
  log_total = jnp.log(jnp.sum(jnp.exp(x - peak), axis=axis, keepdims=True))
  return jnp.exp(x - (peak + log_total))


def _softmax_fwd(logits, where, axis):
  probs = _softmax(logits, where, axis)
  # Whether each row has an unmasked entry: of the mask's (unbroadcast) size
  # divided by the row length, so the mask itself is not kept.
  live = None if where is None else jnp.any(where, axis=axis, keepdims=True)
  return probs, (probs, live)


def _softmax_bwd(axis, residuals, cotangent):
  probs, live = residuals
  # dz = m * p * (dp - <dp, p>): the softmax's derivative with respect to the
  # masked logits, times that of where(m, z, finfo.min). Masked entries of a
  # row with an unmasked one have p = 0 already; a fully masked row has
  # uniform p that does not depend on z, and only ``live`` says so.
  compute = jnp.promote_types(probs.dtype, jnp.float32)
  # <dp, p> as a dot product of the 16-bit arrays with an fp32 result: exact
  # products, an fp32 sum. Widening dp once for both uses instead would let
  # XLA:GPU fuse that cast into the matmul producing dp, which then writes an
  # fp32 [heads, q, k] array (twice the bytes of the attention probabilities)
  # per layer; read as 16 bits by both uses, dp stays 16-bit in memory.
  inner = jnp.einsum("...k,...k->...", _last(cotangent, axis), _last(probs, axis),
                     preferred_element_type=compute)  # fmt: skip
  inner = jnp.expand_dims(inner, axis)
  grad = probs.astype(compute) * (cotangent.astype(compute) - inner)
  if live is not None:
    grad = jnp.where(live, grad, 0)
  return grad.astype(probs.dtype), None


def _last(x: jax.Array, axis: int) -> jax.Array:
  return jnp.moveaxis(x, axis, -1)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


_PV = "...hqk,...khd->...qhd"


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attend(logits, where, value, einsum):
  return einsum(_PV, _softmax(logits, where, -1), value)


def _attend_fwd(logits, where, value, einsum):
  probs = _softmax(logits, where, -1)
  out = einsum(_PV, probs, value)
  live = None if where is None else jnp.any(where, axis=-1, keepdims=True)
  return out, (probs, value, out, live)


def _attend_bwd(einsum, residuals, d_out):
  probs, value, out, live = residuals
  d_probs = einsum("...qhd,...khd->...hqk", d_out, value)
  d_value = einsum("...hqk,...qhd->...khd", probs, d_out)
  # The softmax backward's row sums <dp, p> are <d_out, out> (FlashAttention's D), since
  # dp = d_out v^T and out = p v: a product over the head depth of two [q, heads, depth]
  # arrays instead of a pass over the two [heads, q, k] ones.
  compute = jnp.promote_types(probs.dtype, jnp.float32)
  inner = jnp.einsum("...qhd,...qhd->...hq", d_out, out, preferred_element_type=compute)
  grad = probs.astype(compute) * (d_probs.astype(compute) - inner[..., None])
  if live is not None:
    grad = jnp.where(live, grad, 0)
  return grad.astype(probs.dtype), None, d_value


_attend.defvjp(_attend_fwd, _attend_bwd)


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
  implementation: str = "xla",
) -> jax.Array:
  r"""Scaled dot-product attention with an fp32 softmax and 16-bit matmuls.

  .. math::

    \mathrm{out} = \mathrm{softmax}_{32}\Big(\frac{q k^\top}{\sqrt d} + b,
    \ \mathrm{mask}\Big)\, v

  Shapes follow Flax: ``query`` ``[batch..., q_len, heads, depth]``, ``key``
  and ``value`` ``[batch..., kv_len, kv_heads, depth]`` (``kv_heads`` may
  divide ``heads``: grouped-query attention), ``bias``/``mask`` broadcastable
  to ``[batch..., heads, q_len, kv_len]``.

  Args:
    query: the queries.
    key: the keys.
    value: the values.
    bias: added to the attention logits.
    mask: a boolean mask, ``False`` where attention is not allowed.
    broadcast_dropout: use one dropout mask for the batch and head dimensions.
    dropout_rng: the key for dropout.
    dropout_rate: the probability of dropping an attention weight.
    deterministic: no dropout.
    dtype: the computation dtype (default: the promoted input dtype).
    precision: the matmuls' precision.
    module: the attention module, to ``sow`` the attention weights into
      (``"attention_weights"``), as Flax does.
    force_fp32_for_softmax: ignored: the softmax is always computed in fp32
      (linen's attention module passes its own default, ``False``; swapping
      this function in is how a policy asks for fp32).
    einsum_dot_general: a ``dot_general`` for both matmuls (default
      :func:`jmp_lite.flax.dot_general`).
    qk_attn_weights_einsum: an einsum for the query-key matmul (e.g. a
      quantized one); given together with ``attn_weights_value_einsum``, the
      two replace the default.
    attn_weights_value_einsum: an einsum for the weights-value matmul.
    promote_dtype: NNX's dtype promotion hook, ``promote_dtype((q, k, v),
      dtype=dtype)``; by default the three are cast to ``dtype`` or to their
      common type.
    is_causal: also apply a causal (lower-triangular) mask.
    implementation: ``"xla"``: jmp_lite's attention, as above. ``"cudnn"``:
      cuDNN's fused (flash) attention kernel where the program is lowered for
      a GPU, which writes no ``[heads, q_len, kv_len]`` array in either pass
      (its softmax fp32, its probabilities 16-bit, as here), and jmp_lite's
      attention elsewhere; where JAX refuses to trace the kernel for the call
      (no cuDNN, a shape or dtype it does not support), jmp_lite's attention
      runs and a :class:`~jmp_lite.flax.FusedAttentionUnavailableWarning` says
      so. The kernel has no dropout, no attention weights to ``sow``, no
      einsum hooks and takes rank-4 inputs; ``precision`` applies to the
      fallback only (cuDNN chooses its own).

  These are the arguments of :func:`flax.linen.dot_product_attention` and
  :func:`flax.nnx.dot_product_attention`, with their meanings, and
  :func:`jax.nn.dot_product_attention`'s ``implementation``.

  Returns:
    The attention output, of ``query``'s shape and the (promoted) input dtype.

  Raises:
    ValueError: for ranks or head counts that do not fit together, only one
      of the two einsums, or an ``implementation`` other than ``"xla"`` and
      ``"cudnn"``; with ``"cudnn"``, for dropout (``dropout_rate > 0`` and not
      ``deterministic``), a ``module``, an einsum hook, or inputs not of rank 4.
  """
  del force_fp32_for_softmax  # Flax's modules pass False by default; fp32 is the point here.
  hooks = {
    "einsum_dot_general": einsum_dot_general,
    "qk_attn_weights_einsum": qk_attn_weights_einsum,
    "attn_weights_value_einsum": attn_weights_value_einsum,
  }
  if check_choice(implementation, "implementation", _IMPLEMENTATIONS, type_error=False) == "cudnn":
    shapes = (np.shape(query), np.shape(key), np.shape(value))
    fused_attention.check_supported(shapes, dropout_rate, deterministic, module, hooks)
    own = functools.partial(dot_product_attention, precision=precision, is_causal=is_causal)
    query, key, value = _promoted(query, key, value, dtype, promote_dtype)
    return fused_attention.attention(query, key, value, bias, mask, is_causal, own)
  qk_einsum, pv_einsum = _einsums(
    precision, einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum
  )
  query, key, value = _promoted(query, key, value, dtype, promote_dtype)
  dtype = query.dtype
  heads, kv_heads = _heads(query, key, value)
  logits = _logits(qk_einsum, query, key, heads, kv_heads)
  if bias is not None:
    logits = logits + jnp.asarray(bias, dtype)
  where = _checked_where(logits, _mask(mask, is_causal, logits.shape[-2:]))
  dropout = not deterministic and dropout_rate > 0.0
  # The default 16-bit einsums are linear, which the fused backward's row sums rely on.
  default_einsums = einsum_dot_general is None and attn_weights_value_einsum is None
  if heads == kv_heads and module is None and not dropout and default_einsums:
    return _attend(logits, where, value, pv_einsum)
  weights = _softmax(logits, where, -1)
  if module is not None:
    _sow_weights(module, weights)
  if dropout:
    weights = _dropout(weights, dropout_rng, dropout_rate, broadcast_dropout, dtype)
  return _weighted_values(pv_einsum, weights, value, heads, kv_heads)


def _promoted(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  dtype: Any,
  promote_dtype: Callable[..., Any] | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The three inputs in the computation dtype: by NNX's hook, ``dtype`` or their common type."""
  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    return query, key, value
  dtype = dtype or jnp.result_type(query, key, value)
  return jnp.asarray(query, dtype), jnp.asarray(key, dtype), jnp.asarray(value, dtype)


def _weighted_values(
  pv_einsum: Callable[..., jax.Array],
  weights: jax.Array,
  value: jax.Array,
  heads: int,
  kv_heads: int,
) -> jax.Array:
  """``weights @ value``, ``[batch..., q_len, heads, depth]``."""
  if heads == kv_heads:
    return pv_einsum(_PV, weights, value)
  # grouped-query attention: view the query heads as [kv_heads, groups]
  weights = weights.reshape((*weights.shape[:-3], kv_heads, heads // kv_heads, *weights.shape[-2:]))
  out = pv_einsum("...hgqk,...khd->...qhgd", weights, value)
  return out.reshape((*out.shape[:-3], heads, out.shape[-1]))


def _logits(
  qk_einsum: Callable[..., jax.Array], query: jax.Array, key: jax.Array, heads: int, kv_heads: int
) -> jax.Array:
  """``q k^T / sqrt(depth)``, ``[batch..., heads, q_len, kv_len]``."""
  query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
  if heads == kv_heads:
    return qk_einsum("...qhd,...khd->...hqk", query, key)
  # grouped-query attention: view the query heads as [kv_heads, groups]
  q = query.reshape((*query.shape[:-2], kv_heads, heads // kv_heads, query.shape[-1]))
  logits = qk_einsum("...qhgd,...khd->...hgqk", q, key)
  return logits.reshape((*logits.shape[:-4], heads, *logits.shape[-2:]))


def _einsums(
  precision: Any,
  dot_general: Callable[..., jax.Array] | None,
  qk_einsum: Callable[..., jax.Array] | None,
  pv_einsum: Callable[..., jax.Array] | None,
) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
  """The einsums of the two attention matmuls: the user's pair, or 16-bit ones."""
  if (qk_einsum is None) != (pv_einsum is None):
    raise ValueError(
      "qk_attn_weights_einsum and attn_weights_value_einsum must be given together, got "
      f"{qk_einsum!r} and {pv_einsum!r}."
    )
  if qk_einsum is not None and pv_einsum is not None:
    return qk_einsum, pv_einsum
  einsum = functools.partial(
    jnp.einsum, precision=precision, _dot_general=dot_general or accumulate.dot_general
  )
  return einsum, einsum


def _heads(query: jax.Array, key: jax.Array, value: jax.Array) -> tuple[int, int]:
  """The number of query heads and of key/value heads, checked against each other."""
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
  return heads, kv_heads


def _mask(mask: jax.Array | None, is_causal: bool, lengths: tuple[int, ...]) -> jax.Array | None:
  """The user's mask and the causal one combined (``None`` for neither)."""
  masks = [] if mask is None else [jnp.asarray(mask, jnp.bool_)]
  if is_causal:
    masks.append(jnp.tril(jnp.ones(lengths, jnp.bool_)))
  where = None
  for m in masks:
    where = m if where is None else where & m
  return where


def _dropout(
  weights: jax.Array, rng: jax.Array | None, rate: float, broadcast: bool, dtype: Any
) -> jax.Array:
  """Flax's attention dropout: drops weights with probability ``rate``, rescales the rest."""
  keep_prob = 1.0 - rate
  # With broadcast, one mask shared by the batch and head dimensions, as in Flax.
  shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
  keep = jax.random.bernoulli(rng, keep_prob, shape)  # type: ignore[arg-type]
  return weights * (keep.astype(dtype) / np.asarray(keep_prob, dtype))
