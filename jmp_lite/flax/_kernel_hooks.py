"""The Flax layer kernels jmp_lite swaps in while a layer computes in 16 bits (private).

Flax's dense, convolution, einsum and attention layers take their kernel as
an attribute (``dot_general``, ``conv_general_dilated``, ``einsum_op``,
``attention_fn``). Under a policy, a layer computing in 16 bits that still has
Flax's default gets jmp_lite's (:func:`~jmp_lite.flax.dot_general`...,
:func:`~jmp_lite.flax.dot_product_attention`) instead: :data:`FLAX_HOOKS` lists where, and
:func:`kernel_updates` gives the attributes to set on one layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jmp_lite.flax import _accumulate as accumulate
from jmp_lite.flax import _attention as attention


class KernelHook(NamedTuple):
  """A Flax layer attribute jmp_lite replaces while the layer computes in 16 bits.

  ``attribute`` is set to ``replacement`` on modules of class ``cls`` for
  which ``is_default(module)`` holds: a user's own kernel (say, a quantized
  ``dot_general``) is never replaced.

  Attributes:
    cls: the Flax layer class (its subclasses included).
    attribute: the layer's attribute holding the kernel (``"dot_general"``,
      ``"attention_fn"``...).
    is_default: whether a layer still has Flax's default for ``attribute``.
    replacement: jmp_lite's kernel.
    kind: ``"accumulation"`` or ``"softmax"``: the switch of
      :class:`ModulePolicies` (``fp32_accumulation``, ``fp32_softmax``) that
      enables it.
  """

  cls: type
  attribute: str
  is_default: Callable[[Any], bool]
  replacement: Any
  kind: str


def _default(attribute: str, jax_default: Any) -> Callable[[Any], bool]:
  """Whether a layer still uses Flax's default kernel for ``attribute``.

  Flax spells the default as ``None`` (linen, NNX ``LinearGeneral``) or as
  the JAX function itself (NNX ``Linear``, ``Conv``, ``Einsum``); a
  ``<attribute>_cls`` factory, where the layer has one, also overrides it.
  """

  def is_default(module: Any) -> bool:
    value = getattr(module, attribute, None)
    factory = getattr(module, f"{attribute}_cls", None)
    return factory is None and (value is None or value is jax_default)

  return is_default


_DOT = ("dot_general", lax.dot_general, accumulate.dot_general, "accumulation")
_CONV = (
  "conv_general_dilated",
  lax.conv_general_dilated,
  accumulate.conv_general_dilated,
  "accumulation",
)


def _hook(cls: type, attribute: str, jax_default: Any, replacement: Any, kind: str) -> KernelHook:
  return KernelHook(cls, attribute, _default(attribute, jax_default), replacement, kind)


FLAX_HOOKS: tuple[KernelHook, ...] = (
  _hook(nn.Dense, *_DOT),
  _hook(nn.DenseGeneral, *_DOT),
  _hook(nn.Conv, *_CONV),
  _hook(
    nn.MultiHeadDotProductAttention,
    "attention_fn",
    nn.dot_product_attention,
    attention.dot_product_attention,
    "softmax",
  ),
  _hook(nnx.Linear, *_DOT),
  _hook(nnx.LinearGeneral, *_DOT),
  _hook(nnx.Conv, *_CONV),
  _hook(nnx.Einsum, "einsum_op", jnp.einsum, accumulate.einsum, "accumulation"),
  _hook(
    nnx.MultiHeadAttention,
    "attention_fn",
    nnx.dot_product_attention,
    attention.dot_product_attention,
    "softmax",
  ),
)
"""Flax layers whose default kernels jmp_lite replaces for 16-bit compute.

Not covered (no hook in Flax): linen ``Einsum``, ``ConvTranspose`` and
``Embed.attend``, NNX ``ConvTranspose`` and ``Embed.attend``, and matmuls a
user module writes itself: they run as JAX lowers them (16-bit products, the
same matmuls), without the fp32 output layer or ``grad_reduction_dtype``.
"""


def kernel_updates(
  hooks: tuple[KernelHook, ...], module: Any, options: Mapping[str, Any]
) -> dict[str, Any]:
  """Returns jmp_lite's kernels for the ``hooks`` where ``module`` has Flax's default.

  Args:
    hooks: the hooks enabled for the module (16-bit compute; see
      :class:`~jmp_lite.flax.ModulePolicies`).
    module: a linen or NNX layer.
    options: keywords bound to the accumulation kernels (``output_dtype``,
      ``rhs_grad_dtype`` of :func:`~jmp_lite.flax.dot_general`).

  Returns:
    ``{attribute: kernel}`` to set on ``module``. A layer already given
    jmp_lite's kernel (e.g. by :func:`~jmp_lite.flax.policy_view`) gets it
    again, with ``options``.
  """
  return {
    h.attribute: (
      functools.partial(h.replacement, **options)
      if options and h.kind == "accumulation"
      else h.replacement
    )
    for h in hooks
    if h.is_default(module) or _unwrapped(getattr(module, h.attribute, None)) is h.replacement
  }


def _unwrapped(fn: Any) -> Any:
  """``fn``, or the function a ``functools.partial`` of jmp_lite's options wraps."""
  return fn.func if isinstance(fn, functools.partial) else fn
