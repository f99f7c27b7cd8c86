"""The kinds with one scale for every gradient: their shared half, no-op and static scales."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Self, TypeVar, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _tree_util, _validation
from jmp_lite._loss_scale._contract import GradOptions, ScaledGrads, checked_field
from jmp_lite._loss_scale._finiteness import combine_across, unscaled_all_finite
from jmp_lite._loss_scale._grad import Differentiation, grad_of_scaled_loss

T = TypeVar("T")


def one_scale_grads(tree: Any, loss_scale: Any) -> Any:
  """The bare gradient tree of ``tree``, which must carry ``loss_scale`` everywhere.

  Args:
    tree: a bare tree, or a :class:`ScaledGrads`.
    loss_scale: the loss scale taking it (named in the error).

  Returns:
    ``tree``'s gradients.

  Raises:
    TypeError: for a :class:`ScaledGrads` with ``stats``: its gradients carry
      the scales of the loss scale whose ``value_and_grad`` took them.
  """
  scaled = ScaledGrads.of(tree)
  if scaled.stats is not None:
    raise TypeError(
      f"A {type(loss_scale).__name__} takes gradients that all carry its loss_scale, got a "
      "ScaledGrads with stats (gradients at several scales, from another loss scale's "
      "value_and_grad): unscale them with the loss scale that took them."
    )
  return scaled.grads


class OneScale:
  """The contract's derived half for the kinds whose gradients all carry ``loss_scale``."""

  @property
  def gradient_scale(self: Any) -> Any:
    """``loss_scale``: every gradient carries it."""
    return self.loss_scale

  def value_and_grad(
    self: Any, fun: Callable[..., Any], **options: Unpack[GradOptions]
  ) -> Callable[..., tuple[Any, Any]]:
    return grad_of_scaled_loss(fun, self.scale, **Differentiation.of(options)._asdict())

  def scale(self: Any, tree: T) -> T:
    """Multiplies the floating leaves of ``tree`` by ``loss_scale``.

    Args:
      tree: a scalar loss or a pytree.

    Returns:
      ``tree`` with every floating leaf times ``loss_scale`` (JAX's type
      promotion: a fp32 scale turns a fp16 loss into fp32, as in jmp); other
      leaves (integers, ``float0``) unchanged.
    """
    return _tree_util.scale_tree(tree, self.loss_scale)

  def unscale(self: Any, tree: Any) -> Any:
    """Divides the floating leaves of ``tree`` by ``loss_scale``, in at least fp32.

    Args:
      tree: gradients of the scaled loss (a bare tree), or any tree scaled by
        ``loss_scale``.

    Returns:
      The true values: fp16/bf16 leaves come back as fp32, other leaves
      (integers, ``float0``) unchanged.
    """
    return _tree_util.unscale_tree(one_scale_grads(tree, self), self.loss_scale)

  def unscale_and_adjust(
    self: Any, scaled_grads: Any, params: Any = None, *, axis_name: Any = None
  ):
    scaled_grads = one_scale_grads(scaled_grads, self)

    def unscaled():
      return _tree_util.cast_like_params(self.unscale(scaled_grads), params)

    grads = unscaled()
    finite = combine_across(
      unscaled_all_finite(unscaled, scaled_grads, grads, self.loss_scale), axis_name
    )
    return grads, finite, self.adjust(finite)


class FixedScale(OneScale):
  """The kinds whose scale never moves."""

  @property
  def at_minimum(self) -> jax.Array:
    """Always False: a fixed scale is never pinned at a floor."""
    return jnp.zeros((), jnp.bool_)

  def adjust(self, grads_finite: jax.Array) -> Self:
    """Returns this scale unchanged (``grads_finite`` is still checked).

    Args:
      grads_finite: a bool scalar, whether this step's gradients were finite.

    Returns:
      ``self``.
    """
    _validation.check_predicate(grads_finite, "grads_finite")
    return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(FixedScale):
  """A loss scale of 1: scale and unscale return their input unchanged.

  With :func:`jmp_lite.loss_scaling` it still skips steps with non-finite
  gradients, which is what bf16 training needs.

  >>> NoOpLossScale().scale(jnp.float32(3.0)).item()
  3.0
  """

  @property
  def loss_scale(self) -> np.ndarray:
    """1, as a float32 scalar."""
    return np.ones((), np.float32)

  def scale(self, tree: T) -> T:
    """Returns ``tree`` unchanged: scaling by 1 is the identity.

    Args:
      tree: a loss, or any pytree.

    Returns:
      ``tree`` itself (no cast, no copy).
    """
    return tree

  def unscale(self, tree: Any) -> Any:
    """Returns the gradients of ``tree`` unchanged: unscaling by 1 is the identity.

    Args:
      tree: gradients (a bare tree), or any pytree.

    Returns:
      ``tree`` itself (no cast, no copy).
    """
    return one_scale_grads(tree, self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(FixedScale):
  """Scales and unscales by a fixed ``loss_scale`` (use a power of two).

  ``scale`` multiplies floating leaves by S with JAX's type promotion (a fp32
  S turns a fp16 loss into fp32, as in jmp); ``unscale`` multiplies by 1/S in
  at least fp32, so fp16/bf16 gradients come back as fp32. Non-floating leaves
  (integers, ``float0`` gradients) pass through. The constructor checks
  ``loss_scale`` (a positive, finite real scalar); JAX's unflattening does not.

  >>> scale = StaticLossScale(2.0**10)
  >>> scale.scale(jnp.float32(0.5)).item()
  512.0
  >>> grads = scale.unscale({"w": jnp.full(2, 1024.0, jnp.float16)})
  >>> grads["w"].dtype.name, grads["w"].tolist()
  ('float32', [1.0, 1.0])
  """

  loss_scale: jax.Array
  _checked: bool = checked_field()

  def __post_init__(self):
    if not self._checked:
      scale = _validation.as_scale(self.loss_scale, "loss_scale")
      object.__setattr__(self, "loss_scale", scale)
      object.__setattr__(self, "_checked", True)
