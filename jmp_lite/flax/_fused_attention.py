r"""Attention by cuDNN's fused kernel, which never writes the scores, with an fp32 softmax.

:func:`fused_dot_product_attention` is a drop-in ``attention_fn`` for Flax's
attention modules, as :func:`~jmp_lite.flax.dot_product_attention` is, with the
same semantics: 16-bit matmuls, the softmax computed in fp32, the probabilities
rounded to the compute dtype for the ``p @ v`` matmul. On a GPU it runs
:func:`jax.nn.dot_product_attention`'s cuDNN kernel (flash attention: the
``[heads, q_len, kv_len]`` scores and probabilities stay in on-chip memory, in
fp32, and are recomputed in the backward pass), so neither pass writes a
``T x T`` array. Everywhere else it runs
:func:`~jmp_lite.flax.dot_product_attention`; where JAX refuses to trace
cuDNN's kernel for the call (no cuDNN, a shape or dtype it does not support:
JAX checks when it traces), that is what runs, and a
:class:`FusedAttentionUnavailableWarning` says so. A refusal that JAX only
raises when it lowers for a GPU is an error there, not a fallback.

The kernel is chosen for the platform the program is lowered for
(:func:`jax.lax.platform_dependent`), so one traced step compiles to the
fused kernel for a GPU and to jmp_lite's attention for a TPU or a CPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite.flax._attention import dot_product_attention


class FusedAttentionUnavailableWarning(UserWarning):
  """The fused (cuDNN) attention cannot run this call; jmp_lite's attention runs instead."""


def fused_dot_product_attention(
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
  is_causal: bool = False,
) -> jax.Array:
  r"""Scaled dot-product attention by cuDNN's fused kernel on a GPU, fp32 softmax everywhere.

  .. math::

    \mathrm{out} = \mathrm{softmax}_{32}\Big(\frac{q k^\top}{\sqrt d} + b,
    \ \mathrm{mask}\Big)\, v

  Args:
    query: ``[batch, q_len, heads, depth]``.
    key: ``[batch, kv_len, kv_heads, depth]`` (``kv_heads`` divides ``heads``).
    value: as ``key``.
    bias: added to the logits, broadcastable to ``[batch, heads, q_len, kv_len]``.
    mask: a boolean mask of that shape, ``False`` where attention is not
      allowed. A fully masked row attends uniformly, as in Flax.
    broadcast_dropout: accepted for Flax's modules; dropout is not supported.
    dropout_rng: accepted for Flax's modules.
    dropout_rate: must be 0 unless ``deterministic`` (the fused kernel has no
      dropout).
    deterministic: no dropout.
    dtype: the computation dtype (default: the promoted input dtype).
    precision: the fallback's matmul precision (cuDNN chooses its own).
    module: must be ``None``: the fused kernel has no attention weights to
      ``sow`` (use :func:`~jmp_lite.flax.dot_product_attention` to record them).
    force_fp32_for_softmax: ignored: the softmax is always fp32.
    is_causal: also apply a causal mask (the kernel skips the masked blocks).

  Returns:
    The attention output, of ``query``'s shape and the compute dtype.

  Raises:
    ValueError: for dropout, a ``module`` to sow into, or inputs that are not
      of rank 4.
  """
  del broadcast_dropout, force_fp32_for_softmax
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError(
      f"fused_dot_product_attention has no dropout (dropout_rate={dropout_rate}); use "
      "jmp_lite.flax.dot_product_attention, or deterministic=True."
    )
  if module is not None:
    raise ValueError(
      "fused_dot_product_attention never forms the attention weights, so it cannot sow them "
      "(sow_weights=True); use jmp_lite.flax.dot_product_attention."
    )
  if not query.ndim == key.ndim == value.ndim == 4:
    raise ValueError(
      "fused_dot_product_attention takes [batch, length, heads, depth] inputs, got shapes "
      f"{query.shape}, {key.shape} and {value.shape}."
    )
  dtype = dtype or jnp.result_type(query, key, value)
  query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  if bias is not None:
    bias = jnp.asarray(bias, dtype)
  if mask is not None:
    mask = jnp.asarray(mask, jnp.bool_)

  def own():
    return dot_product_attention(
      query, key, value, bias, mask, precision=precision, is_causal=is_causal
    )

  def fused():
    return jax.nn.dot_product_attention(
      query, key, value, bias, mask, is_causal=is_causal, implementation="cudnn"
    )

  try:
    return lax.platform_dependent(cuda=fused, default=own)
  except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
    # JAX checks cuDNN and the call's support when it traces the kernel.
    warnings.warn(
      f"The fused (cuDNN) attention cannot run this call ({e}); "
      "jmp_lite.flax.dot_product_attention runs instead.",
      FusedAttentionUnavailableWarning,
      stacklevel=2,
    )
    return own()
