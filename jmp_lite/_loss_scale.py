"""Loss scales: keep small fp16 gradients from underflowing.

fp16's smallest subnormal is 2^-24, so gradients below it become zero. Scaling
the loss by S before ``jax.grad`` scales every gradient by S (the chain rule is
linear); dividing by S afterwards, in fp32, recovers the true gradients. With S
a power of two both multiplications are exact.

Three kinds, with jmp's names and constructor order:

* :class:`NoOpLossScale`: S = 1 (fp32 or bf16 training).
* :class:`StaticLossScale`: a fixed S.
* :class:`DynamicLossScale`: S adapts. After ``period`` consecutive finite
  steps it grows by ``factor``; on a non-finite step it shrinks by ``factor``
  (not below ``min_loss_scale``) and the step is skipped by the caller.

Each is an immutable pytree whose state (the scale and counters) are leaves and
whose configuration is static, so it can live in a jitted train step's state
without recompilation as the scale moves.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, Self, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _finite, _tree_util, _validation

T = TypeVar("T")

# A differentiation transform with `jax.value_and_grad`'s signature (`fun, argnums, has_aux`),
# e.g. `flax.nnx.value_and_grad`.
ValueAndGradTransform = Callable[..., Callable[..., Any]]


@runtime_checkable
class LossScale(Protocol):
  r"""The loss-scale contract: what every kind of loss scale implements.

  A loss scale is an immutable pytree (its state as leaves, its configuration
  static) that knows how to differentiate a scaled loss and how to turn the
  resulting gradients back into true ones. Everything in jmp_lite that scales a
  loss (:func:`jmp_lite.loss_scaling`, :func:`jmp_lite.scaled_value_and_grad`,
  the Flax ``TrainState`` and ``Optimizer``, fp8, the diagnostics) goes through
  these members and nothing else, so a new kind plugs in everywhere:

  .. math::

    (\ell, \hat g) = \texttt{value\_and\_grad}(f)(\theta), \qquad
    (g, \text{finite}, \text{next}) = \texttt{unscale\_and\_adjust}(\hat g, \theta)

  with :math:`\hat g` the gradients of the scaled loss and :math:`g` the true
  ones. :class:`NoOpLossScale`, :class:`StaticLossScale` and
  :class:`DynamicLossScale` scale every gradient by one value (``uniform`` is
  True); :class:`jmp_lite.LayerwiseLossScale` gives each stage of the network its
  own (``uniform`` is False: then ``loss_scale`` is the loss's own scale, not
  every gradient's, and ``scale`` refuses, since a plain ``jax.grad`` of a
  scaled loss cannot give stages different scales).
  """

  uniform: ClassVar[bool]
  """Whether every gradient carries the one scale ``loss_scale``."""

  @property
  def loss_scale(self) -> jax.Array | np.ndarray:
    """The factor the loss is multiplied by (a scalar)."""
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

  def unscale(self, tree: T) -> T:
    """Divides scaled gradients by the scale each carries, in at least fp32.

    Args:
      tree: gradients of the scaled loss.

    Returns:
      The true gradients; floating leaves at least fp32.
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
    self,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: Any = None,
    value_and_grad: ValueAndGradTransform = jax.value_and_grad,
  ) -> Callable[..., tuple[Any, Any]]:
    """Like ``value_and_grad(fun)``, with the gradients of the scaled loss.

    Args:
      fun: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``).
      has_aux: as in :func:`jax.value_and_grad`.
      argnums: which argument(s) to differentiate, in the form that
        ``value_and_grad`` takes (e.g. an ``nnx.DiffState`` for
        :func:`flax.nnx.value_and_grad`). ``None`` (default): not passed, so
        the transform's own default applies (the first argument), and
        transforms that take no ``argnums`` (``eqx.filter_value_and_grad``)
        work.
      value_and_grad: the differentiation transform, with
        :func:`jax.value_and_grad`'s signature (``fun, argnums, has_aux``;
        ``argnums`` only when given).

    Returns:
      A function with ``fun``'s signature returning ``(value, scaled_grads)``:
      ``value`` is ``fun``'s own, unscaled; ``scaled_grads`` is what
      :meth:`unscale` and :meth:`unscale_and_adjust` take.
    """
    ...

  def unscale_and_adjust(
    self, scaled_grads: Any, params: Any = None, *, axis_name: Any = None
  ) -> tuple[Any, jax.Array, Self]:
    """Unscales, checks finiteness once and adjusts: one step's bookkeeping.

    Args:
      scaled_grads: what :meth:`value_and_grad` returned.
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


class _UniformScale:
  """The contract's derived half for kinds with one scale for every gradient."""

  uniform: ClassVar[bool] = True

  def value_and_grad(
    self: Any,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: Any = None,
    value_and_grad: ValueAndGradTransform = jax.value_and_grad,
  ) -> Callable[..., tuple[Any, Any]]:
    return grad_of_scaled_loss(
      fun, self.scale, has_aux=has_aux, argnums=argnums, value_and_grad=value_and_grad
    )

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

  def unscale(self: Any, tree: T) -> T:
    """Divides the floating leaves of ``tree`` by ``loss_scale``, in at least fp32.

    Args:
      tree: gradients of the scaled loss.

    Returns:
      The true gradients: fp16/bf16 leaves come back as fp32, other leaves
      (integers, ``float0``) unchanged.
    """
    return _tree_util.unscale_tree(tree, self.loss_scale)

  def unscale_and_adjust(
    self: Any, scaled_grads: Any, params: Any = None, *, axis_name: Any = None
  ):
    def unscaled():
      return _tree_util.cast_like_params(self.unscale(scaled_grads), params)

    grads = unscaled()
    finite = _combine(
      _unscaled_all_finite(unscaled, scaled_grads, grads, self.loss_scale), axis_name
    )
    return grads, finite, self.adjust(finite)


class _FixedScale(_UniformScale):
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


@_tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(_FixedScale):
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
    """Returns ``tree`` unchanged: scaling and unscaling by 1 are identities.

    Args:
      tree: a loss, or any pytree.

    Returns:
      ``tree`` itself (no cast, no copy).
    """
    return tree

  unscale = scale


@_tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_FixedScale):
  """Scales and unscales by a fixed ``loss_scale`` (use a power of two).

  ``scale`` multiplies floating leaves by S with JAX's type promotion (a fp32
  S turns a fp16 loss into fp32, as in jmp); ``unscale`` multiplies by 1/S in
  at least fp32, so fp16/bf16 gradients come back as fp32. Non-floating leaves
  (integers, ``float0`` gradients) pass through.

  >>> scale = StaticLossScale(2.0**10)
  >>> scale.scale(jnp.float32(0.5)).item()
  512.0
  >>> grads = scale.unscale({"w": jnp.full(2, 1024.0, jnp.float16)})
  >>> grads["w"].dtype.name, grads["w"].tolist()
  ('float32', [1.0, 1.0])
  """

  loss_scale: jax.Array

  def __post_init__(self):
    object.__setattr__(self, "loss_scale", _validation.as_scale(self.loss_scale, "loss_scale"))


@_tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_UniformScale):
  """A loss scale that finds the largest value keeping gradients finite.

  ``adjust(grads_finite)`` implements::

    if grads_finite:
      overflow_streak = 0
      counter += 1
      if counter == period:
        counter = 0
        if loss_scale * factor is finite and <= max_loss_scale:
          loss_scale *= factor
    else:
      counter = 0
      overflow_streak += 1
      if overflow_streak >= hysteresis:
        loss_scale = max(loss_scale / factor, min_loss_scale)

  With the defaults (``hysteresis=1``, no ``max_loss_scale``) this is jmp's
  rule. Unlike jmp, ``min_loss_scale`` survives ``jit``/``tree_map``/``scan``,
  fp16 and bf16 scales work (arithmetic stays in the scale's dtype), and
  growth never reaches inf.

  Args:
    loss_scale: initial scale, a positive scalar; its dtype (default float32
      for Python numbers) is kept. Use a power of two, e.g. ``2.0 ** 15``.
    counter: consecutive finite steps so far, in ``[0, period)``.
    period: finite steps between growths, >= 1.
    factor: growth and back-off factor, > 1 (2 keeps powers of two exact).
    min_loss_scale: the scale never goes below this, a number >= 0 (0, which
      jmp accepts, warns: the scale can then reach 0 and stay there).
    max_loss_scale: the scale never grows above this (default: no bound but
      finiteness in the scale's dtype).
    hysteresis: back off only after this many consecutive non-finite steps
      (then on each further one); 1 backs off on every overflow.
    overflow_streak: consecutive non-finite steps so far (state, usually 0).

  >>> scale = DynamicLossScale(2.0 ** 15, period=2)
  >>> float(scale.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale)
  65536.0
  """

  loss_scale: jax.Array
  counter: jax.Array = 0  # type: ignore[assignment]  # made an array in __post_init__
  period: int = dataclasses.field(default=2000, metadata=_tree_util.STATIC)
  factor: float = dataclasses.field(default=2, metadata=_tree_util.STATIC)
  min_loss_scale: float = dataclasses.field(default=1.0, metadata=_tree_util.STATIC)
  _: dataclasses.KW_ONLY
  max_loss_scale: float | None = dataclasses.field(default=None, metadata=_tree_util.STATIC)
  hysteresis: int = dataclasses.field(default=1, metadata=_tree_util.STATIC)
  overflow_streak: jax.Array = 0  # type: ignore[assignment]  # made an array in __post_init__

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    scale = _validation.as_scale(self.loss_scale, "loss_scale", warn_integer=True)
    set_("loss_scale", scale)
    period = self.period
    if isinstance(period, (float, np.floating)) and float(period).is_integer():
      period = int(period)  # jmp accepts period=2000.0; 2000.5 still raises below
    set_("period", _validation.check_int(period, "period", 1))
    set_("hysteresis", _validation.check_int(self.hysteresis, "hysteresis", 1))
    factor = _validation.as_real(self.factor, "factor", "a real number > 1")
    if not (math.isfinite(factor) and factor > 1):
      raise ValueError(f"factor must be finite and > 1, got {self.factor}.")
    low = _validation.as_bound(
      self.min_loss_scale, "min_loss_scale", scale.dtype, allow_zero=True, warn_integer=True
    )
    if low == 0:
      # jmp accepts a zero floor, so code written for it must keep running; the collapse it
      # allows is silent in training, so say it here.
      warnings.warn(
        "min_loss_scale=0: a run of non-finite steps can divide the loss scale down to 0 "
        "(it underflows), and at 0 every unscaled gradient is 0 * (1/0) = NaN, so every later "
        "step is skipped and the scale never recovers. Pass a positive floor (the default is "
        "1.0) to prevent this.",
        UserWarning,
        stacklevel=3,  # __post_init__ <- __init__ <- the caller
      )
    set_("min_loss_scale", low)
    if self.max_loss_scale is not None:
      high = _validation.as_bound(self.max_loss_scale, "max_loss_scale", scale.dtype)
      if high < low:
        raise ValueError(f"max_loss_scale={high} is below min_loss_scale={low}.")
      set_("max_loss_scale", high)
    if _validation.is_concrete(scale) and not (
      low <= float(scale) <= (self.max_loss_scale or math.inf)
    ):
      raise ValueError(
        f"loss_scale={float(scale)} is outside [min_loss_scale, max_loss_scale]"
        f" = [{low}, {self.max_loss_scale}]."
      )
    set_("counter", self._as_count(self.counter, "counter", self.period - 1))
    set_(
      "overflow_streak", self._as_count(self.overflow_streak, "overflow_streak", self.hysteresis)
    )

  @staticmethod
  def _as_count(value: Any, name: str, largest: int) -> jax.Array:
    count = jnp.asarray(value)
    if not jnp.issubdtype(count.dtype, jnp.integer) or count.shape != ():
      raise TypeError(f"{name} must be an integer scalar, got {value!r}.")
    count = jnp.asarray(count, jnp.int32)
    if _validation.is_concrete(count) and not 0 <= int(count) <= largest:
      raise ValueError(f"{name} must be in [0, {largest}], got {int(count)}.")
    return count

  @property
  def at_minimum(self) -> jax.Array:
    """Whether the scale is at ``min_loss_scale`` (a bool scalar)."""
    return self.loss_scale <= jnp.asarray(self.min_loss_scale, self.loss_scale.dtype)

  def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
    """The next state, by the rule above.

    Args:
      grads_finite: a bool scalar, whether this step's gradients were finite.

    Returns:
      The loss scale for the next step (a non-finite step also resets
      ``counter``).
    """
    finite = _validation.check_predicate(grads_finite, "grads_finite")
    scale = self.loss_scale

    grown = scale * self.factor
    can_grow = jnp.isfinite(grown)
    if self.max_loss_scale is not None:
      can_grow &= grown <= self.max_loss_scale
    grow = (self.counter == self.period - 1) & can_grow
    streak = jnp.where(finite, 0, jnp.minimum(self.overflow_streak + 1, self.hysteresis))
    shrink = ~finite & (streak >= self.hysteresis)
    shrunk = jnp.maximum(scale / self.factor, jnp.asarray(self.min_loss_scale, scale.dtype))

    return _tree_util.replace_fields(
      self,
      loss_scale=jnp.where(finite, jnp.where(grow, grown, scale), jnp.where(shrink, shrunk, scale)),
      counter=jnp.where(finite, (self.counter + 1) % self.period, 0),
      overflow_streak=streak,
    )


class UserCall(NamedTuple):
  """The user's call inside a wrapped one: how errors name its arguments."""

  fun: Callable[..., Any]  # the user's function: its parameter names name the arguments
  args: Callable[[tuple], tuple]  # the wrapped call's positional arguments -> the user's
  argnums: Any  # the user's argnums (None: the transform's default)


def grad_of_scaled_loss(
  fun: Callable[..., Any],
  scale_loss: Callable[[Any], Any],
  *,
  has_aux: bool,
  argnums: Any,
  value_and_grad: ValueAndGradTransform,
  user_call: UserCall | None = None,
) -> Callable[..., tuple[Any, Any]]:
  """``value_and_grad`` of ``scale_loss(fun(...))`` that returns ``fun``'s own value.

  The body of :meth:`LossScale.value_and_grad` for every kind that scales the
  loss (the layer-wise scale passes a ``fun`` that activates its boundaries).

  Args:
    fun: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``).
    scale_loss: multiplies the loss by the scale the gradients are to carry.
    has_aux, argnums, value_and_grad: as in :meth:`LossScale.value_and_grad`
      (``argnums=None`` is not passed to ``value_and_grad``).
    user_call: when ``fun`` wraps the user's function with other arguments
      (the layer-wise scale's probes), how to name the user's arguments in
      errors (default: ``fun``'s own, as called).

  Returns:
    A function with ``fun``'s signature returning ``(value, scaled_grads)``.

  Raises:
    TypeError: when ``value_and_grad`` rejects the arguments before calling
      ``fun`` and leaves of the differentiated arguments are not floating-point
      arrays: the error names each such leaf by its path.
  """
  entered = []  # whether the transform got as far as calling fun

  def scaled_fun(*args, **kwargs):
    entered.append(True)
    out = fun(*args, **kwargs)
    value, aux = out if has_aux else (out, None)
    return scale_loss(value), (value, aux)

  selection = {} if argnums is None else {"argnums": argnums}
  grad_fn = value_and_grad(scaled_fun, has_aux=True, **selection)

  def value_and_scaled_grad(*args, **kwargs):
    entered.clear()
    try:
      (_, (value, aux)), grads = grad_fn(*args, **kwargs)
    except TypeError as error:
      call = user_call or UserCall(fun, lambda given: given, argnums)
      found = [] if entered else _non_float_leaves(call.fun, call.args(args), call.argnums)
      if not found:
        raise
      raise TypeError(_non_float_message(value_and_grad, call.argnums, found)) from error
    return ((value, aux) if has_aux else value), grads

  return value_and_scaled_grad


def _non_float_leaves(fun: Callable[..., Any], args: tuple, argnums: Any) -> list[str]:
  """``"path: what"`` for each leaf of the differentiated arguments that is not a float array."""
  selected = 0 if argnums is None else argnums
  if isinstance(selected, int) and not isinstance(selected, bool):
    selected = (selected,)
  if not (
    isinstance(selected, tuple)
    and all(isinstance(i, int) and not isinstance(i, bool) for i in selected)
  ):
    return []  # a transform-specific selection (nnx.DiffState...): nothing to name
  try:
    names = [
      p.name
      for p in inspect.signature(fun).parameters.values()
      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
  except (TypeError, ValueError):  # no signature (some builtins and C callables)
    names = []
  found = []
  for index in selected:
    if not -len(args) <= index < len(args):
      return []
    index %= len(args)
    name = names[index] if index < len(names) else f"args[{index}]"
    for path, leaf in jax.tree_util.tree_flatten_with_path(args[index])[0]:
      what = _not_float(leaf)
      if what is not None:
        found.append(f"{name}{jax.tree_util.keystr(path)}: {what}")
  return found


def _not_float(leaf: Any) -> str | None:
  """What ``leaf`` is if ``jax.grad`` cannot differentiate it (None if it can)."""
  if isinstance(leaf, (float, complex)) and not isinstance(leaf, bool):
    return None
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and not isinstance(leaf, type):
    try:
      if jnp.issubdtype(dtype, jnp.inexact):
        return None
      return np.dtype(dtype).name
    except TypeError:  # an extended dtype, e.g. a PRNG key
      return str(dtype)
  if isinstance(leaf, (bool, int)):
    return f"a Python {type(leaf).__name__}"
  if callable(leaf):
    kind = type(leaf).__name__
    return "a function" if kind == "function" else f"a function ({kind})"
  return f"a {type(leaf).__name__}"


def _non_float_message(value_and_grad: Any, argnums: Any, found: list[str]) -> str:
  module = getattr(value_and_grad, "__module__", None) or ""
  transform = (
    ".".join(filter(None, [module.split(".")[0], getattr(value_and_grad, "__qualname__", None)]))
    or type(value_and_grad).__name__
  )
  shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
  which = "the first argument" if argnums is None else f"argnums={argnums!r}"
  return (
    f"{transform} differentiates every leaf of {which}, and accepts only floating-point or "
    f"complex arrays (and Python floats), but these leaves are not: {shown}. For an Equinox "
    "module pass value_and_grad=eqx.filter_value_and_grad (it differentiates the "
    "floating-point arrays and leaves the rest); otherwise move the other leaves into an "
    "argument that argnums does not select (e.g. with eqx.partition)."
  )


def uniform_scale_value(loss_scale: Any, *, instead: str) -> jax.Array:
  """The one scale every gradient carries, as a float32 scalar.

  The one way to read a scale's value from what a user passes as
  ``loss_scale``: a loss scale whose ``uniform`` is True, a number or a scalar
  array.

  Args:
    loss_scale: a :class:`LossScale`, a positive number or a scalar array.
    instead: what to do instead, for the error a non-uniform loss scale (e.g.
      a :class:`jmp_lite.LayerwiseLossScale`) raises.

  Returns:
    ``loss_scale``'s value, a float32 scalar (traced if ``loss_scale`` is).

  Raises:
    TypeError: for a non-uniform loss scale, a bool, or anything else that is
      not a real number or a real array.
    ValueError: for a real array that is not a scalar, or a concrete value
      that is not positive and finite.
  """
  if isinstance(loss_scale, LossScale):
    if not loss_scale.uniform:
      raise TypeError(
        f"loss_scale: a {type(loss_scale).__name__} gives each stage its own scale, and "
        f"this needs the one scale every gradient carries. {instead}"
      )
    loss_scale = loss_scale.loss_scale
  expected = "a positive number, a scalar array or a jmp_lite.LossScale"
  return _validation.as_scale(loss_scale, "loss_scale", expected=expected).astype(jnp.float32)


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite (a bool scalar).

  Non-floating leaves (integers, ``float0``) are ignored; an empty tree is
  finite. With ``axis_name`` (a name or tuple of names bound by ``shard_map``,
  ``pmap`` or ``vmap``) the answer is combined across that axis, so every
  device takes the same decision. Under sharded ``jit`` no axis name is needed:
  the reduction is already global.

  Args:
    tree: any pytree.
    axis_name: the mapped axis (or axes) to agree across, or None.

  Returns:
    A bool scalar: True if no floating leaf holds an inf or NaN.

  >>> all_finite({"w": jnp.ones(3), "step": jnp.array(7)}).item()
  True
  >>> all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf], jnp.float16)]).item()
  False
  """
  leaves = _finite.inexact_leaves(tree)
  # Exact on every backend; a sum guarded by a conditional on XLA:CPU, one
  # fused all(isfinite) pass elsewhere (jmp_lite/_finite.py says why).
  finite = _finite.all_finite(lambda: leaves) if leaves else jnp.array(True)
  return _combine(finite, axis_name)


def _combine(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Makes every device along ``axis_name`` take the same decision."""
  if axis_name is not None:
    finite = lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite


def _unscaled_all_finite(
  unscaled: Callable[[], Any], scaled_grads: Any, grads: Any, loss_scale: Any
) -> jax.Array:
  """``all_finite(grads)`` for ``grads = unscaled()``, reading the gradients once.

  The check traces its own unscale (XLA merges the copies): XLA:GPU and TPU
  fuse it into the ``all(isfinite)`` reduction. XLA:CPU sums the scaled
  gradients instead, which vouch for the unscaled ones when ``1/S <= 1`` and
  the cast to the parameter dtype does not narrow (fp32 to fp16 can overflow a
  finite value: such leaves are summed after the cast); its exact fallback
  unscales inside the conditional, so the unscaled gradients are never
  materialised for it.
  """
  if not _finite.inexact_leaves(grads):
    return jnp.array(True)
  proxies = []
  for scaled, grad in zip(
    jax.tree_util.tree_leaves(scaled_grads), jax.tree_util.tree_leaves(grads), strict=True
  ):
    if _finite.is_inexact(grad):
      wide = jnp.promote_types(jnp.result_type(scaled), jnp.float32)
      proxies.append(scaled if jnp.promote_types(wide, grad.dtype) == grad.dtype else grad)
  return _finite.all_finite(
    lambda: _finite.inexact_leaves(unscaled()), proxies, jnp.asarray(loss_scale) >= 1
  )


def select_tree(pred: jax.Array, a: T, b: T) -> T:
  """Leaf-wise ``a if pred else b`` for two trees of the same structure.

  Args:
    pred: a bool scalar (checked at trace time).
    a: the tree taken where ``pred`` is True.
    b: the tree taken where ``pred`` is False; matching leaves must have the
      same shape and dtype as ``a``'s.

  Returns:
    A tree with their structure, each leaf selected with ``lax.select`` (no
    branch, so it costs the same either way under ``jit``); a non-array leaf
    (an Equinox module's function) the two trees share is taken as it is.

  Raises:
    TypeError: for non-array leaves that differ (named by their path).

  >>> select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
  [0.0, 0.0]
  """
  return _tree_util.select_leaves(_validation.check_predicate(pred, "pred"), a, b)
