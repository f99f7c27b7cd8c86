"""A one-call check that a training step wires loss scaling correctly.

Two mistakes train badly without any error: gradients of the *unscaled* loss
passed to :func:`jmp_lite.loss_scaling`'s ``update`` (every update is then
``1/S`` of what it should be), and a transformation placed before
``loss_scaling`` in a chain (``optax.chain(clip_by_global_norm(1.0),
loss_scaling(...))``: the clipping sees scaled gradients). Neither can be
seen from the types, but both show in how the gradients reaching ``update``
respond to the loss scale: :func:`check_loss_scaling` runs the step twice with
the scale multiplied by two different factors and compares.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._loss_scale import LossScale, NoOpLossScale
from jmp_lite._transform import LossScalingState


@dataclasses.dataclass(eq=False)
class _Recorder:
  """Host-side record of one run: squared norms of the true gradients."""

  from_value_and_grad: list[float] = dataclasses.field(default_factory=list)
  at_update: list[float] = dataclasses.field(default_factory=list)

  def record(self, where: str):
    def callback(sq_norm):
      getattr(self, where).append(float(np.max(np.asarray(sq_norm))))

    return callback


def _sq_norm(tree: Any) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves), jnp.float32(0))


@dataclasses.dataclass(frozen=True, eq=False)
class _ProbeScale:
  """A loss scale that multiplies ``inner``'s scale by ``factor`` and records what it sees.

  Unscaling still divides by ``inner``'s scale only: the true gradients it
  records are then ``factor`` times the true ones, if (and only if) the
  gradients reaching ``update`` were computed at this scale.
  """

  inner: Any
  factor: float  # static: NNX updates the inner scale's Variables in place
  recorder: _Recorder

  @property
  def uniform(self) -> bool:
    return self.inner.uniform

  @property
  def loss_scale(self) -> jax.Array:
    return self.inner.loss_scale * jnp.float32(self.factor)

  @property
  def at_minimum(self) -> jax.Array:
    return self.inner.at_minimum

  def scale(self, tree: Any) -> Any:
    def scale_leaf(x):
      if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return x
      return x * jnp.asarray(self.factor, jnp.result_type(x))

    return jax.tree.map(scale_leaf, self.inner.scale(tree))

  def unscale(self, tree: Any) -> Any:
    return self.inner.unscale(tree)

  def adjust(self, grads_finite: jax.Array) -> _ProbeScale:
    return dataclasses.replace(self, inner=self.inner.adjust(grads_finite))

  def value_and_grad(self, fun: Callable[..., Any], *, has_aux: bool = False, **kwargs: Any):
    def scaled_fun(*args, **kw):
      out = fun(*args, **kw)
      value, aux = out if has_aux else (out, None)
      scaled = value * jnp.asarray(self.factor, jnp.result_type(value))
      return (scaled, aux) if has_aux else scaled

    grad_fn = self.inner.value_and_grad(scaled_fun, has_aux=has_aux, **kwargs)

    def value_and_scaled_grad(*args, **kw):
      out, grads = grad_fn(*args, **kw)
      jax.debug.callback(
        self.recorder.record("from_value_and_grad"), _sq_norm(self.inner.unscale(grads))
      )
      value, aux = out if has_aux else (out, None)
      value = value / jnp.asarray(self.factor, jnp.result_type(value))
      return ((value, aux) if has_aux else value), grads

    return value_and_scaled_grad

  def unscale_and_adjust(self, scaled_grads: Any, params: Any = None, *, axis_name: Any = None):
    jax.debug.callback(
      self.recorder.record("at_update"), _sq_norm(self.inner.unscale(scaled_grads))
    )
    grads, finite, next_scale = self.inner.unscale_and_adjust(
      scaled_grads, params, axis_name=axis_name
    )
    return grads, finite, dataclasses.replace(self, inner=next_scale)


jax.tree_util.register_pytree_node(
  _ProbeScale,
  lambda p: ((p.inner,), (p.factor, p.recorder)),
  lambda aux, children: _ProbeScale(children[0], *aux),
)


def _is_state(x: Any) -> bool:
  return isinstance(x, LossScalingState)


def _copy_leaf(x: Any) -> Any:
  # A step may donate its arguments: the probe runs must not consume the caller's buffers.
  return jnp.array(x, copy=True) if isinstance(x, jax.Array) else x


def _check_factor(factor: Any) -> None:
  if not (isinstance(factor, float | int) and 0 < factor < 1 and math.log2(factor).is_integer()):
    raise ValueError(f"factor must be a power of two below 1, got {factor!r}.")


def _the_loss_scale(args: tuple, kwargs: dict) -> LossScale:
  """The loss scale of the one loss scaling state among the step's arguments."""
  found = [x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_state) if _is_state(x)]
  if len(found) != 1:
    raise ValueError(
      f"check_loss_scaling needs exactly one loss scaling state among the step's arguments, "
      f"found {len(found)}: pass the optimizer state (or TrainState) the step takes."
    )
  loss_scale = found[0].loss_scale
  if not isinstance(loss_scale, LossScale):
    raise TypeError(f"The loss scaling state holds {type(loss_scale).__name__}, not a LossScale.")
  return loss_scale


def _probe_run(step: Callable[..., Any], args: tuple, kwargs: dict, factor: float) -> _Recorder:
  """Runs ``step`` on copies of its arguments, the loss scale multiplied by ``factor``."""
  recorder = _Recorder()

  def probe(x):
    if _is_state(x):
      x = jax.tree.map(_copy_leaf, x)
      return x._replace(loss_scale=_ProbeScale(x.loss_scale, factor, recorder))
    return _copy_leaf(x)

  probe_args, probe_kwargs = jax.tree.map(probe, (args, kwargs), is_leaf=_is_state)
  jax.block_until_ready(step(*probe_args, **probe_kwargs))
  jax.effects_barrier()
  return recorder


def _update_norms(first: _Recorder, second: _Recorder) -> tuple[float, float]:
  """The norms of the true gradients reaching ``update`` in both runs, when comparable."""
  if not first.at_update or not second.at_update:
    raise ValueError(
      "The step never called loss_scaling's update with the loss scaling state it was given."
    )
  n1, n2 = math.sqrt(first.at_update[0]), math.sqrt(second.at_update[0])
  if not (math.isfinite(n1) and math.isfinite(n2)):
    raise ValueError(
      "The step's gradients are not finite at the current loss scale, so the check cannot "
      "compare them: run it on a batch (or with a loss scale) that does not overflow."
    )
  if n1 == 0:
    raise ValueError("The step's gradients are all zero: run the check on a batch that has some.")
  return n1, n2


def _diagnosis(first: _Recorder, n1: float, ratio: float, factor: float) -> str:
  """What is wrong with a step whose gradients changed by ``ratio`` instead of ``factor``."""
  if first.from_value_and_grad:
    computed = math.sqrt(first.from_value_and_grad[0])
    if abs(computed - n1) > 1e-3 * computed:
      return (
        "The gradients changed between the scaled value-and-grad and loss_scaling's update "
        f"(norm {computed:.6g} -> {n1:.6g}, true units): a transformation before loss_scaling "
        "sees scaled gradients, e.g. optax.chain(optax.clip_by_global_norm(...), "
        "jl.loss_scaling(...)), which clips S times too early. Put loss_scaling outermost: "
        "jl.loss_scaling(optax.chain(optax.clip_by_global_norm(...), optimizer), loss_scale)."
      )
  if abs(ratio - 1) <= 1e-3 and not first.from_value_and_grad:
    return (
      "The gradients reaching loss_scaling's update do not carry the loss scale (scaling it by "
      f"{factor:g} changed them by {ratio:.6g}). Either they are gradients of the unscaled loss "
      "(every update is then 1/S of what it should be: take them with "
      "jl.scaled_value_and_grad(loss_fn, opt_state) or differentiate loss_scale.scale(loss)), "
      "or a transformation before loss_scaling, such as optax.clip_by_global_norm, sees the "
      "scaled gradients (put loss_scaling outermost: jl.loss_scaling(optax.chain(clip, "
      "optimizer), loss_scale))."
    )
  if abs(ratio - 1) <= 1e-3:
    return (
      "The gradients reaching loss_scaling's update do not carry the loss scale (scaling it by "
      f"{factor:g} changed them by {ratio:.6g}): they are gradients of the unscaled loss, so "
      "every update is 1/S of what it should be. Take them with "
      "jl.scaled_value_and_grad(loss_fn, opt_state), TrainState.value_and_grad or "
      "Optimizer.value_and_grad (or differentiate loss_scale.scale(loss))."
    )
  return (
    f"Scaling the loss by {factor:g} changed the gradients reaching loss_scaling's update by "
    f"{ratio:.6g}: something between the loss and the update does not scale linearly (a "
    "transformation before loss_scaling, or gradients modified in the step)."
  )


def check_loss_scaling(
  step: Callable[..., Any], *args: Any, factor: float = 2.0**-4, **kwargs: Any
) -> None:
  r"""Checks that ``step`` feeds ``loss_scaling`` the gradients of the scaled loss.

  Runs ``step(*args, **kwargs)`` twice on copies of its arguments, the loss
  scale :math:`S` held in them (in a :class:`jmp_lite.LossScalingState`,
  e.g. an optax state or a Flax ``TrainState``) replaced by :math:`S` and by
  :math:`fS`. The gradients reaching ``loss_scaling``'s ``update``, divided by
  :math:`S`, must then differ by exactly the factor :math:`f`. They do not
  when the step differentiates the unscaled loss (ratio 1), or when a
  transformation before ``loss_scaling`` (clipping) changes them on the way.
  The arguments are not modified; a jitted step compiles twice more.

  Run it once on a small batch before training, e.g. in a test::

    jl.check_loss_scaling(train_step, params, opt_state, x, y)

  Args:
    step: the training step, as the training loop calls it (jitted or not).
    *args: its positional arguments; exactly one loss scaling state must be
      among ``args`` and ``kwargs``.
    factor: :math:`f`, the second run's scale multiplier (a power of two,
      below 1 so the second run cannot overflow where the first did not).
    **kwargs: its keyword arguments.

  Raises:
    ValueError: naming the mistake and its fix, with the measured ratio; or
      when the check cannot run (no or several loss scaling states, ``update``
      never called, gradients not finite or all zero).
    TypeError: when the state holds no :class:`~jmp_lite.LossScale`.
  """
  _check_factor(factor)
  loss_scale = _the_loss_scale(args, kwargs)
  if isinstance(loss_scale, NoOpLossScale):
    return  # scaled and unscaled gradients coincide, now and later: nothing can go wrong
  first, second = _probe_run(step, args, kwargs, 1.0), _probe_run(step, args, kwargs, factor)
  n1, n2 = _update_norms(first, second)
  ratio = n2 / n1
  if abs(ratio / factor - 1) > 1e-3:
    raise ValueError(_diagnosis(first, n1, ratio, factor))
