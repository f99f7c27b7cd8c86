"""The value and the gradients of a scaled loss, and errors that name the user's arguments."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._loss_scale._contract import GradOptions, ValueAndGradTransform


class Differentiation(NamedTuple):
  """A loss scale's :class:`GradOptions`, checked, each set or at its default."""

  has_aux: bool = False
  argnums: Any = None
  value_and_grad: ValueAndGradTransform = jax.value_and_grad

  @classmethod
  def of(cls, options: Mapping[str, Any]) -> Differentiation:
    """The options a ``value_and_grad`` was given, checked.

    Args:
      options: its keyword arguments besides ``fun``.

    Returns:
      The :class:`Differentiation` they ask for.

    Raises:
      TypeError: for a keyword that is no :class:`GradOptions` field.
    """
    unknown = sorted(set(options) - set(GradOptions.__optional_keys__))
    if unknown:
      raise TypeError(
        f"value_and_grad got unexpected keyword arguments {unknown}; a loss scale's "
        "value_and_grad takes has_aux, argnums and value_and_grad (jmp_lite.GradOptions)."
      )
    return cls(**options)


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
