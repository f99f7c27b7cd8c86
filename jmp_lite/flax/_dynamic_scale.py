r"""A drop-in for Flax's ``flax.training.dynamic_scale.DynamicScale``.

A Flax codebase switches by changing one import::

  from jmp_lite.flax import dynamic_scale as dynamic_scale_lib
  # was: from flax.training import dynamic_scale as dynamic_scale_lib

The constructor fields, their pytree roles (``growth_factor``,
``backoff_factor``, ``growth_interval`` and ``minimum_scale`` static;
``fin_steps`` and ``scale`` leaves), the ``value_and_grad`` signature and its
``(dynamic_scale, is_fin, value, grads)`` result are Flax's, and a checkpoint
holding a Flax ``DynamicScale`` restores into this one (and back). One step is

.. math::

  g = \operatorname{pmean}_{\text{axis}}\!\left(\frac{\nabla (S \cdot f)}{S}\right)
  \text{ in at least fp32}, \qquad
  \text{is\_fin} = \operatorname{all}(\operatorname{isfinite}(g)),

then :meth:`DynamicScale.adjust` moves :math:`S` by the rule of Flax's current
upstream (growth on the ``growth_interval``-th consecutive finite step).

Where Flax is weaker, this class differs (docs/migrating-from-flax.md lists
every difference): the scale is a strongly typed float32 scalar from the start
(Flax's Python-float default scales a fp16 loss in fp16, where 65536 is inf,
and changes type after the first step, so ``jit`` compiles twice); the value
returned is ``fun``'s own, not ``(S \cdot f) / S``; the scale never reaches 0,
inf or float32's (non power-of-two) maximum; and :meth:`DynamicScale.select`
keeps the parameters, the optimizer state and batch statistics on a skipped
step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Self, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization
from jax import lax

from jmp_lite import _tree_util, _validation
from jmp_lite._loss_scale import STATIC, all_finite, checked_field, grad_of_scaled_loss, select_tree

T = TypeVar("T")

# Flax's default floor, and ours when ``minimum_scale`` is None (Flax's lets the scale reach 0).
_TINY = float(np.finfo(np.float32).tiny)


class DynamicScaleResult(NamedTuple):
  """What the function from :meth:`DynamicScale.value_and_grad` returns (Flax's field names).

  Attributes:
    dynamic_scale: the loss scale for the next step.
    finite: whether every gradient is finite (a bool scalar, the same on
      every device of ``axis_name``).
    aux: ``fun``'s value: the loss, or ``(loss, aux)`` with ``has_aux``.
    grad: the true (unscaled) gradients, at least fp32, averaged over
      ``axis_name``.
  """

  dynamic_scale: DynamicScale
  finite: jax.Array
  aux: Any
  grad: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicScale:
  """Dynamic loss scaling with Flax's ``DynamicScale`` interface.

  ``value_and_grad(fun)`` differentiates ``scale * fun``, unscales the
  gradients in at least fp32, averages them over ``axis_name`` and checks that
  they are finite; :meth:`adjust` then gives the next scale by Flax's upstream
  rule, with the scale kept in ``[minimum_scale, float32 max]``::

    if is_fin:
      if fin_steps + 1 >= growth_interval:  # the growth_interval-th finite step
        fin_steps = 0
        if scale * growth_factor is finite:
          scale *= growth_factor
      else:
        fin_steps += 1
    else:
      fin_steps = 0
      scale = max(scale * backoff_factor, minimum_scale or float32 tiny)

  The constructor and :meth:`replace` (through which ``flax.serialization``
  restores a checkpoint) check the fields and copy the arrays they are given:
  a step that donates a state holding this scale deletes no other scale's
  buffers. Unflattening the pytree (``jax.tree.map``, ``jit`` outputs, orbax's
  restore) checks nothing and keeps the arrays it is given (orbax restores
  into new arrays).

  Flax 0.12 and older grow one step later (when ``fin_steps ==
  growth_interval``), so a ``fin_steps`` equal to ``growth_interval`` from
  their checkpoints grows on the next finite step.

  Attributes:
    growth_factor: how much the scale grows after ``growth_interval``
      consecutive finite steps, finite and >= 1 (default 2; 1 never grows).
    backoff_factor: how much it shrinks on a non-finite step, in (0, 1)
      (default 0.5).
    growth_interval: consecutive finite steps per growth, >= 1 (default 2000).
    fin_steps: consecutive finite steps since the last growth or back-off (an
      int32 scalar, >= 0).
    scale: the factor the loss is multiplied by (a float32 scalar, positive,
      finite and >= the floor; default 65536).
    minimum_scale: the floor of the scale (default float32's smallest normal
      number, Flax's default); ``None`` means that default too (Flax's lets the
      scale reach 0).

  >>> import jmp_lite.flax as jlf
  >>> ds = jlf.DynamicScale(growth_interval=2, scale=4.0)
  >>> for p in [1.0, jnp.inf, 1.0, 1.0]:
  ...   ds, is_fin, loss, grad = ds.value_and_grad(lambda p: p**2)(p)
  ...   print(bool(is_fin), float(ds.scale))
  True 4.0
  False 2.0
  True 2.0
  True 4.0
  """

  growth_factor: float = dataclasses.field(default=2.0, metadata=STATIC)
  backoff_factor: float = dataclasses.field(default=0.5, metadata=STATIC)
  growth_interval: int = dataclasses.field(default=2000, metadata=STATIC)
  fin_steps: jax.Array = 0  # type: ignore[assignment]  # made an array in __post_init__
  scale: jax.Array = 65536.0  # type: ignore[assignment]  # made an array in __post_init__
  minimum_scale: float | None = dataclasses.field(default=_TINY, metadata=STATIC)
  _checked: bool = checked_field()

  def __post_init__(self):
    if not self._checked:
      for name, value in _checked_fields(self).items():
        object.__setattr__(self, name, value)
      object.__setattr__(self, "_checked", True)

  @property
  def _floor(self) -> float:
    return _TINY if self.minimum_scale is None else self.minimum_scale

  def replace(self, **updates: Any) -> Self:
    """A copy with some fields replaced, checked as by the constructor (Flax's ``replace``).

    Args:
      **updates: new values of fields, by name.

    Returns:
      The new ``DynamicScale``.
    """
    return dataclasses.replace(self, _checked=False, **updates)

  def adjust(self, is_fin: jax.Array) -> DynamicScale:
    """The next state, by the rule above (``value_and_grad`` calls it).

    Args:
      is_fin: a bool scalar, whether this step's gradients were finite.

    Returns:
      The ``DynamicScale`` for the next step.
    """
    finite = _validation.check_predicate(is_fin, "is_fin")
    scale = jnp.asarray(self.scale, jnp.float32)  # a leaf set by jax.tree.map may be a float
    grow = finite & (self.fin_steps + 1 >= self.growth_interval)
    grown = scale * jnp.float32(self.growth_factor)
    shrunk = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(self._floor))
    return dataclasses.replace(
      self,
      fin_steps=jnp.where(finite & ~grow, self.fin_steps + 1, 0).astype(jnp.int32),
      scale=jnp.where(finite, jnp.where(grow & jnp.isfinite(grown), grown, scale), shrunk),
    )

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: Any = None,
  ) -> Callable[..., DynamicScaleResult]:
    """:func:`jax.value_and_grad` of ``fun`` under loss scaling (Flax's signature).

    Args:
      fun: the loss function; returns a scalar (or ``(loss, aux)`` with
        ``has_aux``).
      argnums: which positional argument(s) to differentiate, as for
        :func:`jax.value_and_grad`.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      axis_name: under ``pmap``/``shard_map``, the axis (or axes) to average
        the gradients over, so every device takes the same decision; ``None``
        under ``jit`` (sharded or not), where the check is already global.

    Returns:
      A function with ``fun``'s arguments returning a
      :class:`DynamicScaleResult` ``(dynamic_scale, is_fin, value, grads)``:
      the next state, whether the gradients are finite, ``fun``'s own value
      (not rescaled) and the true gradients, floating leaves at least fp32
      (fp16 and bf16 come back as fp32), averaged over ``axis_name``.
    """
    has_aux = _validation.check_bool(has_aux, "has_aux")
    scale = jnp.asarray(self.scale, jnp.float32)
    grad_fn = grad_of_scaled_loss(
      fun,
      lambda loss: loss * scale,
      has_aux=has_aux,
      argnums=argnums,
      value_and_grad=jax.value_and_grad,
    )

    def value_and_unscaled_grad(*args: Any, **kwargs: Any) -> DynamicScaleResult:
      value, scaled_grads = grad_fn(*args, **kwargs)
      grads = _tree_util.unscale_tree(scaled_grads, scale)
      if axis_name is not None:
        grads = lax.pmean(grads, axis_name)
      # Checked after the average, as Flax does: a non-finite value on any device makes the
      # average non-finite on all of them, and an average that overflows is caught too.
      finite = all_finite(grads)
      return DynamicScaleResult(self.adjust(finite), finite, value, grads)

    return value_and_unscaled_grad

  @staticmethod
  def select(is_fin: jax.Array, new: T, old: T) -> T:
    """Leaf-wise ``new if is_fin else old``: keeps a skipped step's state as it was.

    Flax's examples write ``jax.tree.map(functools.partial(jnp.where, is_fin),
    new, old)`` for the parameters and optimizer state, and forget batch
    statistics; pass all three, or a whole train state::

      new_state = state.apply_gradients(grads=grads, batch_stats=stats)
      new_state = dynamic_scale.select(
          is_fin, new_state.replace(dynamic_scale=dynamic_scale), state)

    Every :class:`DynamicScale` in ``new`` is kept whatever ``is_fin`` (a
    skipped step must still lower the scale, or the next step overflows
    again). Other leaves, integer ones such as a train state's ``step`` and
    the optimizer's step count included, are selected: a whole state's
    ``step`` then counts applied steps.

    Args:
      is_fin: the bool scalar ``value_and_grad`` returned.
      new: the state after the step (any pytree).
      old: the state before it, with ``new``'s structure, shapes and dtypes.

    Returns:
      ``new`` where ``is_fin``, else ``old``, leaf by leaf (``lax.select``: no
      branch under ``jit``).
    """
    is_fin = _validation.check_predicate(is_fin, "is_fin")

    def keep(n, o):
      return n if isinstance(n, DynamicScale) else select_tree(is_fin, n, o)

    return jax.tree.map(keep, new, old, is_leaf=lambda x: isinstance(x, DynamicScale))


def _checked_fields(ds: DynamicScale) -> dict[str, Any]:
  """Every field of a new ``ds``, checked and normalized, its arrays copied."""
  growth = _validation.as_real(ds.growth_factor, "growth_factor", "a number >= 1")
  if not (math.isfinite(growth) and growth >= 1):
    raise ValueError(f"growth_factor must be finite and >= 1, got {growth}.")
  backoff = _validation.as_real(ds.backoff_factor, "backoff_factor", "a number in (0, 1)")
  if not 0 < backoff < 1:
    raise ValueError(f"backoff_factor must be in (0, 1), got {backoff}.")
  interval = ds.growth_interval
  if isinstance(interval, (float, np.floating)) and float(interval).is_integer():
    interval = int(interval)  # Flax accepts growth_interval=2000.0; 2000.5 still raises
  interval = _validation.check_int(interval, "growth_interval", 1)
  minimum = ds.minimum_scale
  if minimum is not None:
    minimum = _validation.as_bound(minimum, "minimum_scale", np.dtype(np.float32))
  # Strongly typed float32 from the start: a weakly typed Python float would scale a fp16
  # loss in fp16 and change type after the first step (a second compilation).
  scale = _validation.as_scale(ds.scale, "scale").astype(jnp.float32)
  floor = _TINY if minimum is None else minimum
  if _validation.is_concrete(scale) and float(scale) < floor:
    raise ValueError(f"scale={float(scale)} is below minimum_scale={floor}.")
  fin_steps = jnp.asarray(ds.fin_steps)
  if not jnp.issubdtype(fin_steps.dtype, jnp.integer) or fin_steps.shape != ():
    raise TypeError(f"fin_steps must be an integer scalar, got {ds.fin_steps!r}.")
  fin_steps = fin_steps.astype(jnp.int32)
  if _validation.is_concrete(fin_steps) and int(fin_steps) < 0:
    raise ValueError(f"fin_steps must be >= 0, got {int(fin_steps)}.")
  return {
    "growth_factor": growth,
    "backoff_factor": backoff,
    "growth_interval": interval,
    "minimum_scale": minimum,
    # Buffers of its own (here and in `replace`): a step that donates a state holding this
    # scale must not delete the arrays it was built from, nor those of the scale it replaced.
    "scale": _tree_util.copy_arrays(scale),
    "fin_steps": _tree_util.copy_arrays(fin_steps),
  }


# Flax's checkpoints (flax.serialization, flax.training.checkpoints) hold the leaves by name,
# as for Flax's own struct: {"fin_steps": ..., "scale": ...}.
_STATE_FIELDS = ("fin_steps", "scale")


def _to_state_dict(ds: DynamicScale) -> dict[str, Any]:
  return {name: serialization.to_state_dict(getattr(ds, name)) for name in _STATE_FIELDS}


def _from_state_dict(target: DynamicScale, state: dict[str, Any]) -> DynamicScale:
  if set(state) != set(_STATE_FIELDS):
    raise ValueError(
      f"A DynamicScale's state dict has the keys {sorted(_STATE_FIELDS)}, got {sorted(state)}"
      f" at path {serialization.current_path()}."
    )
  return target.replace(
    **{
      name: serialization.from_state_dict(getattr(target, name), state[name], name=name)
      for name in _STATE_FIELDS
    }
  )


serialization.register_serialization_state(DynamicScale, _to_state_dict, _from_state_dict)
