r"""Attention by cuDNN's fused kernel, which never writes the scores, with an fp32 softmax.

:func:`~jmp_lite.flax.dot_product_attention` with ``implementation="cudnn"``
runs :func:`attention`: the same semantics as jmp_lite's own attention
(16-bit matmuls, the softmax computed in fp32, the probabilities rounded to
the compute dtype for the ``p @ v`` matmul), on a GPU by
:func:`jax.nn.dot_product_attention`'s cuDNN kernel (flash attention: the
``[heads, q_len, kv_len]`` scores and probabilities stay in on-chip memory, in
fp32, and are recomputed in the backward pass), so neither pass writes a
``T x T`` array. Everywhere else the caller's fallback, jmp_lite's attention,
runs; where JAX refuses to trace cuDNN's kernel for the call (no cuDNN, a
shape or dtype it does not support: JAX checks when it traces), that is what
runs, and a :class:`FusedAttentionUnavailableWarning` says so. A refusal that
JAX only raises when it lowers for a GPU is an error there, not a fallback.

The kernel is chosen for the platform the program is lowered for
(:func:`jax.lax.platform_dependent`), so one traced step compiles to the
fused kernel for a GPU and to jmp_lite's attention for a TPU or a CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_INSTEAD = 'use implementation="xla"'


class FusedAttentionUnavailableWarning(UserWarning):
  """The fused (cuDNN) attention cannot run this call; jmp_lite's attention runs instead."""


def check_supported(
  shapes: tuple[tuple[int, ...], ...],
  dropout_rate: float,
  deterministic: bool,
  module: Any,
  hooks: Mapping[str, Any],
) -> None:
  """Refuses what cuDNN's fused kernel cannot do, naming the argument.

  Args:
    shapes: the query's, key's and value's shapes.
    dropout_rate: the attention dropout rate.
    deterministic: no dropout.
    module: the module to ``sow`` the attention weights into, or ``None``.
    hooks: the einsum hooks by argument name (``None`` where not given).

  Raises:
    ValueError: for dropout, a ``module``, an einsum hook, or inputs that are
      not of rank 4.
  """
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError(
      f'implementation="cudnn" has no dropout (dropout_rate={dropout_rate}); {_INSTEAD}, '
      "or deterministic=True."
    )
  if module is not None:
    raise ValueError(
      'implementation="cudnn" never forms the attention weights, so it cannot sow them into '
      f"module={module!r} (sow_weights=True); {_INSTEAD}."
    )
  for name, hook in hooks.items():
    if hook is not None:
      raise ValueError(
        f'implementation="cudnn" computes both matmuls in cuDNN\'s kernel, not by '
        f"{name}={hook!r}; {_INSTEAD}."
      )
  if any(len(shape) != 4 for shape in shapes):
    shown = ", ".join(map(str, shapes))
    raise ValueError(
      'implementation="cudnn" takes [batch, length, heads, depth] inputs, got shapes '
      f"{shown}; {_INSTEAD}."
    )


def attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None,
  mask: jax.Array | None,
  is_causal: bool,
  fallback: Callable[..., jax.Array],
) -> jax.Array:
  """cuDNN's fused attention where the program is lowered for a GPU, ``fallback`` elsewhere.

  Args:
    query: ``[batch, q_len, heads, depth]``, in the compute dtype.
    key: ``[batch, kv_len, kv_heads, depth]``, in the compute dtype.
    value: as ``key``.
    bias: added to the logits, or ``None``.
    mask: a boolean mask, ``False`` where attention is not allowed, or ``None``.
    is_causal: also apply a causal mask (the kernel skips the masked blocks).
    fallback: jmp_lite's attention, called as ``fallback(query, key, value,
      bias, mask)``.

  Returns:
    The attention output, of ``query``'s shape and dtype.
  """
  if bias is not None:
    bias = jnp.asarray(bias, query.dtype)
  if mask is not None:
    mask = jnp.asarray(mask, jnp.bool_)

  def own():
    return fallback(query, key, value, bias, mask)

  def fused():
    return jax.nn.dot_product_attention(
      query, key, value, bias, mask, is_causal=is_causal, implementation="cudnn"
    )

  try:
    return lax.platform_dependent(cuda=fused, default=own)
  except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
    # JAX checks cuDNN and the call's support when it traces the kernel.
    warnings.warn(
      f"The fused (cuDNN) attention cannot run this call ({e}); jmp_lite's attention "
      '(implementation="xla") runs instead.',
      FusedAttentionUnavailableWarning,
      stacklevel=3,  # attention <- dot_product_attention <- its caller
    )
    return own()
