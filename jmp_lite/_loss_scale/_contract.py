r"""The loss-scale contract: the protocol, the scaled gradients, and how a value is recognised.

Every kind of loss scale implements :class:`LossScale` in full, so a caller
never asks which kind it holds: it differentiates with ``value_and_grad``,
hands the gradients to ``unscale_and_adjust`` (or ``unscale``), and reads one
value, ``gradient_scale``, where it needs the single scale of every gradient.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, Self, TypedDict, TypeVar, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _validation

T = TypeVar("T")

# A differentiation transform with `jax.value_and_grad`'s signature (`fun, argnums, has_aux`),
# e.g. `flax.nnx.value_and_grad`.
ValueAndGradTransform = Callable[..., Callable[..., Any]]


class GradOptions(TypedDict, total=False):
  """The keyword options of every loss scale's ``value_and_grad``, each optional.

  :meth:`LossScale.value_and_grad` and :func:`jmp_lite.scaled_value_and_grad`
  take them as keywords, e.g. ``scale.value_and_grad(loss_fn, has_aux=True)``.

  Attributes:
    has_aux: ``fun`` returns ``(loss, aux)``, as in :func:`jax.value_and_grad`
      (default False).
    argnums: which argument(s) to differentiate, in the form that
      ``value_and_grad`` takes (e.g. an ``nnx.DiffState`` for
      :func:`flax.nnx.value_and_grad`). Absent or ``None`` (default): not
      passed, so the transform's own default applies (the first argument), and
      transforms that take no ``argnums`` (``eqx.filter_value_and_grad``) work.
    value_and_grad: the differentiation transform, with
      :func:`jax.value_and_grad`'s signature (``fun, argnums, has_aux``;
      ``argnums`` only when given); default :func:`jax.value_and_grad`.
  """

  has_aux: bool
  argnums: Any
  value_and_grad: ValueAndGradTransform


STATIC: Mapping[str, bool] = types.MappingProxyType({"static": True})
"""Field metadata for :func:`jax.tree_util.register_dataclass`: static pytree data.

A field declared ``dataclasses.field(default=2000, metadata=STATIC)`` is part
of the treedef (hashable; ``jit`` retraces when it changes); the other fields
are the pytree's leaves.
"""


def checked_field() -> Any:
  """The ``_checked`` field of a loss scale: whether its values were checked (static data).

  :func:`jax.tree_util.register_dataclass` rebuilds a pytree by calling its
  class with every field, leaves that may be tracers or placeholders
  (``object()``, ``None``) included. A user's construction leaves ``_checked``
  False, so ``__post_init__`` checks and normalizes the fields and sets it; the
  treedef then carries True, so JAX's unflattening (and ``dataclasses.replace``,
  which copies it) rebuilds the object without checking anything.

  Returns:
    A keyword-only, static, unprinted dataclass field defaulting to False.
  """
  return dataclasses.field(default=False, repr=False, kw_only=True, metadata=STATIC)


class ScaledGrads(NamedTuple):
  """The gradients of a scaled loss, for every kind of loss scale.

  What :meth:`LossScale.value_and_grad` gives and :meth:`LossScale.unscale`
  and :meth:`LossScale.unscale_and_adjust` take. ``stats`` is None when every
  gradient carries the loss scale's ``loss_scale``; that case is written as the
  bare gradient tree (what ``jax.grad`` of ``scale(loss)`` returns, and what
  the kinds with one scale give), so :meth:`of` reads either form. A
  :class:`jmp_lite.LayerwiseLossScale` fills ``stats`` with its stage
  boundaries' statistics (each stage's gradients then carry its own scale).

  Attributes:
    grads: the parameter gradients, with the parameters' structure.
    stats: what the loss scale measured besides (its own pytree, kept per
      device: ``unscale_and_adjust`` combines it over ``axis_name``), or None.
  """

  grads: Any
  stats: Any = None

  @classmethod
  def of(cls, scaled: Any) -> ScaledGrads:
    """``scaled`` as a :class:`ScaledGrads`: a bare gradient tree is ``ScaledGrads(tree)``.

    Args:
      scaled: what a ``value_and_grad`` returned as the gradients, or the
        gradients of ``scale(loss)``.

    Returns:
      The :class:`ScaledGrads`.
    """
    return scaled if isinstance(scaled, ScaledGrads) else cls(scaled)

  def packed(self) -> Any:
    """The form ``value_and_grad`` returns: the bare ``grads`` when ``stats`` is None, else self.

    Returns:
      ``grads`` or this :class:`ScaledGrads`.
    """
    return self.grads if self.stats is None else self


class LossScale(Protocol):
  r"""The loss-scale contract: what every kind of loss scale implements, in full.

  A loss scale is an immutable pytree (its state as leaves, its configuration
  static) that differentiates a scaled loss and turns the resulting gradients
  back into true ones. Everything in jmp_lite that scales a loss
  (:func:`jmp_lite.loss_scaling`, :func:`jmp_lite.scaled_value_and_grad`, the
  Flax ``TrainState`` and ``Optimizer``, fp8, the diagnostics) goes through
  these members and nothing else, so a new kind plugs in everywhere:

  .. math::

    (\ell, \hat g) = \texttt{value\_and\_grad}(f)(\theta), \qquad
    (g, \text{finite}, \text{next}) = \texttt{unscale\_and\_adjust}(\hat g, \theta)

  with :math:`\hat g` the gradients of the scaled loss and :math:`g` the true
  ones. The gradients come in one type for every kind, :class:`ScaledGrads`:
  a kind that gives each gradient the one scale ``loss_scale`` returns the bare
  gradient tree (:class:`NoOpLossScale`, :class:`StaticLossScale`,
  :class:`DynamicLossScale`); :class:`jmp_lite.LayerwiseLossScale`, whose
  stages each carry their own scale, fills ``ScaledGrads.stats``. Every kind
  also takes a bare tree to be the gradients of ``scale(loss)``, every leaf at
  ``loss_scale`` (``jax.grad`` of a scaled loss), except in a layer-wise scale's
  ``unscale_and_adjust`` with several stages, which refuses it (a ``TypeError``):
  updating each stage's scale needs the boundary statistics. A caller that needs the one
  scale of every gradient (fp8's matmuls, gradient statistics) reads
  ``gradient_scale``, which is None when there is no such value.

  This is a static protocol (type checkers check implementations against it);
  :func:`is_loss_scale` recognises a value at run time from its type's methods,
  evaluating no property.
  """

  @property
  def loss_scale(self) -> jax.Array | np.ndarray:
    """The factor the loss is multiplied by (a scalar)."""
    ...

  @property
  def gradient_scale(self) -> jax.Array | np.ndarray | None:
    """The one scale every gradient of :meth:`value_and_grad` carries, or None.

    A scalar (``loss_scale`` for the kinds with one scale); None when the
    gradients carry different scales (a layer-wise scale with several stages).
    """
    ...

  @property
  def at_minimum(self) -> jax.Array:
    """Whether the scale is pinned at its floor (a bool scalar; False if fixed)."""
    ...

  def scale(self, tree: T) -> T:
    """Multiplies a loss (or any tree of floating values) by ``loss_scale``.

    Args:
      tree: a scalar loss or a pytree; non-floating leaves pass through.

    Returns:
      ``tree`` scaled, with its structure.
    """
    ...

  def unscale(self, tree: Any) -> Any:
    """Divides scaled gradients by the scale each carries, in at least fp32.

    Args:
      tree: what :meth:`value_and_grad` returned as the gradients, or a bare
        tree scaled by ``loss_scale`` (the gradients of :meth:`scale`'s loss).

    Returns:
      The true values, with the parameters' (or ``tree``'s) structure;
      floating leaves at least fp32.
    """
    ...

  def adjust(self, grads_finite: jax.Array) -> Self:
    """The next state, given only whether this step's gradients were finite.

    Args:
      grads_finite: a bool scalar.

    Returns:
      The loss scale for the next step.
    """
    ...

  def value_and_grad(
    self, fun: Callable[..., Any], **options: Unpack[GradOptions]
  ) -> Callable[..., tuple[Any, Any]]:
    """Like ``value_and_grad(fun)``, with the gradients of the scaled loss.

    Args:
      fun: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``).
      **options: ``has_aux``, ``argnums``, ``value_and_grad``: see
        :class:`GradOptions`.

    Returns:
      A function with ``fun``'s signature returning ``(value, scaled_grads)``:
      ``value`` is ``fun``'s own, unscaled; ``scaled_grads`` a
      :class:`ScaledGrads` in its packed form (see :meth:`ScaledGrads.packed`).
    """
    ...

  def unscale_and_adjust(
    self, scaled_grads: Any, params: Any = None, *, axis_name: Any = None
  ) -> tuple[Any, jax.Array, Self]:
    """Unscales, checks finiteness once and adjusts: one step's bookkeeping.

    Args:
      scaled_grads: what :meth:`value_and_grad` returned, or the gradients of
        :meth:`scale`'s loss.
      params: the parameters; the true gradients are cast to at least fp32
        and at least their dtypes (``None``: to at least fp32).
      axis_name: under ``shard_map``/``pmap``, the axis whose devices must
        agree on finiteness.

    Returns:
      ``(grads, finite, next_loss_scale)``: the true gradients with the
      parameters' structure, whether all of them are finite (a bool scalar,
      the same on every device of ``axis_name``), and the loss scale for the
      next step.
    """
    ...


# What a value's type must define to be taken as a loss scale: the contract's methods. Its
# properties are left out, as a dataclass field is no class attribute.
_METHODS = ("scale", "unscale", "adjust", "value_and_grad", "unscale_and_adjust")


def is_loss_scale(x: Any) -> bool:
  """Whether ``x`` implements :class:`LossScale`: its type defines the contract's methods.

  Only the type is looked at, so no property of ``x`` is evaluated (a
  runtime-checkable protocol's ``isinstance`` evaluates them: JAX ops).

  Args:
    x: any value.

  Returns:
    True for every kind of loss scale, and for a user's own kind.
  """
  kind = type(x)
  return all(callable(getattr(kind, name, None)) for name in _METHODS)


def gradient_scale_value(loss_scale: Any, *, instead: str) -> jax.Array:
  """The one scale every gradient carries, as a float32 scalar.

  The one way to read a scale's value from what a user passes as
  ``loss_scale``: a loss scale (its ``gradient_scale``), a number or a scalar
  array.

  Args:
    loss_scale: a :class:`LossScale`, a positive number or a scalar array.
    instead: what to do instead, for the error a loss scale without one
      gradient scale (e.g. a :class:`jmp_lite.LayerwiseLossScale` with several
      stages) raises.

  Returns:
    ``loss_scale``'s value, a float32 scalar (traced if ``loss_scale`` is).

  Raises:
    TypeError: for a loss scale whose ``gradient_scale`` is None, a bool, or
      anything else that is not a real number or a real array.
    ValueError: for a real array that is not a scalar, or a concrete value
      that is not positive and finite.
  """
  if is_loss_scale(loss_scale):
    value = loss_scale.gradient_scale
    if value is None:
      raise TypeError(
        f"loss_scale: the gradients of this {type(loss_scale).__name__} carry more than one "
        "scale (its gradient_scale is None: a layer-wise scale gives each stage its own "
        f"scale), and this needs the one scale every gradient carries. {instead}"
      )
    loss_scale = value
  expected = "a positive number, a scalar array or a jmp_lite.LossScale"
  return _validation.as_scale(loss_scale, "loss_scale", expected=expected).astype(jnp.float32)
