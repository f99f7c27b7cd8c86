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
import warnings
from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _tree_util
from jmp_lite._loss_scale import STATIC, GradOptions, LossScale, is_loss_scale
from jmp_lite._transform import is_loss_scaling_state, loss_scaling_states


@dataclasses.dataclass(eq=False)
class _Recorder:
  """Host-side record of one run: squared norms of the true gradients, steps returned."""

  from_value_and_grad: list[float] = dataclasses.field(default_factory=list)
  at_update: list[float] = dataclasses.field(default_factory=list)
  # The `steps` counter of each loss scaling state among the step's outputs.
  returned_steps: list[int] = dataclasses.field(default_factory=list)

  def record(self, where: str):
    def callback(sq_norm):
      getattr(self, where).append(float(np.max(np.asarray(sq_norm))))

    return callback


def _sq_norm(tree: Any) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves), jnp.float32(0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _ProbeScale:
  """A loss scale that multiplies ``inner``'s scale by ``factor`` and records what it sees.

  Unscaling still divides by ``inner``'s scale only: the true gradients it
  records are then ``factor`` times the true ones, if (and only if) the
  gradients reaching ``update`` were computed at this scale.
  """

  inner: Any
  factor: float = dataclasses.field(metadata=STATIC)  # NNX updates the inner scale in place
  recorder: _Recorder = dataclasses.field(metadata=STATIC)

  @property
  def loss_scale(self) -> jax.Array:
    return self.inner.loss_scale * jnp.float32(self.factor)

  @property
  def gradient_scale(self) -> jax.Array | None:
    inner = self.inner.gradient_scale
    return None if inner is None else inner * jnp.float32(self.factor)

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

  def value_and_grad(self, fun: Callable[..., Any], **options: Unpack[GradOptions]):
    has_aux = options.get("has_aux", False)

    def scaled_fun(*args, **kw):
      out = fun(*args, **kw)
      value, aux = out if has_aux else (out, None)
      scaled = value * jnp.asarray(self.factor, jnp.result_type(value))
      return (scaled, aux) if has_aux else scaled

    grad_fn = self.inner.value_and_grad(scaled_fun, **options)

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


def _check_factor(factor: Any) -> None:
  if not (isinstance(factor, float | int) and 0 < factor < 1 and math.log2(factor).is_integer()):
    raise ValueError(f"factor must be a power of two below 1, got {factor!r}.")


def _the_loss_scale(args: tuple, kwargs: dict) -> tuple[LossScale, int]:
  """The loss scale and ``steps`` of the one loss scaling state among the step's arguments."""
  found = loss_scaling_states((args, kwargs))
  if len(found) != 1:
    leaves = jax.tree.leaves((args, kwargs), is_leaf=is_loss_scaling_state)
    nested = len(found) - sum(map(is_loss_scaling_state, leaves))  # those inside another
    inside = f" ({nested} of them inside another: loss scaling applied twice)" if nested else ""
    raise ValueError(
      f"check_loss_scaling needs exactly one loss scaling state among the step's arguments, "
      f"found {len(found)}{inside}: pass the optimizer state (or TrainState) the step takes, "
      "built with a single jl.loss_scaling."
    )
  loss_scale = found[0].loss_scale
  if not is_loss_scale(loss_scale):
    raise TypeError(
      f"The loss scaling state holds a {type(loss_scale).__name__}, not a jmp_lite.LossScale "
      "(a type defining scale, unscale, adjust, value_and_grad and unscale_and_adjust)."
    )
  return loss_scale, _host_int(found[0].steps)


def _host_int(x: Any) -> int:
  """``x`` as an int, the largest value for a state replicated over devices (``pmap``)."""
  return int(np.max(np.asarray(x)))


def _probe_run(
  step: Callable[..., Any], args: tuple, kwargs: dict, loss_scale: LossScale, factor: float
) -> _Recorder:
  """Runs ``step`` on copies of its arguments, the loss scale ``loss_scale`` times ``factor``."""
  recorder = _Recorder()

  def probe(x):
    # A step may donate its arguments: the probe runs must not consume the caller's buffers.
    x = _tree_util.copy_arrays(x)
    if is_loss_scaling_state(x):
      return x._replace(
        loss_scale=_ProbeScale(_tree_util.copy_arrays(loss_scale), factor, recorder)
      )
    return x

  probe_args, probe_kwargs = jax.tree.map(probe, (args, kwargs), is_leaf=is_loss_scaling_state)
  out = jax.block_until_ready(step(*probe_args, **probe_kwargs))
  jax.effects_barrier()
  recorder.returned_steps = [_host_int(x.steps) for x in loss_scaling_states(out)]
  if not recorder.at_update:
    raise ValueError(
      "The step never called loss_scaling's update with the loss scaling state it was given."
    )
  return recorder


# Runs at most, backing off: from 2^15, a scale far below any the model could need (an inf or
# NaN in the batch or the model stays at every scale), even with a hysteresis of 2.
_MAX_RUNS = 64


def _fitting_run(
  step: Callable[..., Any], args: tuple, kwargs: dict, loss_scale: LossScale
) -> tuple[_Recorder, LossScale]:
  """The first run, at the largest scale (``loss_scale``, backed off by its own rule) that fits.

  A batch that overflows at the starting scale (2^15 overflows many models' first
  steps) is what a dynamic scale handles by skipping and backing off: the check
  does the same, down to the scale's floor.
  """
  scale, floor = loss_scale, False
  for _ in range(_MAX_RUNS):
    run = _probe_run(step, args, kwargs, scale, 1.0)
    if math.isfinite(run.at_update[0]):
      return run, scale
    lower = scale.adjust(jnp.array(False))
    floor = _same_state(lower, scale)
    if floor:
      break
    scale = lower
  raise ValueError(_not_finite_message(loss_scale, scale, floor))


def _not_finite_message(start: LossScale, last: LossScale, floor: bool) -> str:
  """Why the gradients are not finite at ``start`` nor at ``last``, where backing off stopped.

  At a scale of 1 or below, loss scaling inflates nothing: the inf or NaN is
  the batch's, the model's or the loss's. Above 1, a lower scale may fit.
  """
  first, final = _host_float(start.loss_scale), _host_float(last.loss_scale)
  tried = f"at the loss scale {first:g} ({type(start).__name__})"
  if final != first:
    tried += f" nor backed off to {final:g}"
  if final <= 1:
    return (
      f"The step's gradients are not finite {tried}: at a scale of 1 or below nothing "
      "overflows because of loss scaling, so an inf or NaN is in the batch, the model or the "
      "loss; the check cannot compare the gradients. Run it on a batch whose loss and "
      "gradients are finite without loss scaling."
    )
  why = (
    "this loss scale goes no lower (a fixed scale, or the floor min_loss_scale): every step "
    "would be skipped"
    if floor
    else f"backing it off {_MAX_RUNS} times did not make them finite"
  )
  lower = max(0, math.floor(math.log2(final)) - 7)
  return (
    f"The step's gradients are not finite {tried}, and {why}; the check cannot compare them. "
    "Run it on a batch without inf or NaN, or start from a lower scale, e.g. "
    f"loss_scale = jl.DynamicLossScale(jnp.float32(2.0 ** {lower})), passed where the state "
    "is built: tx = jl.loss_scaling(optimizer, loss_scale) and tx.init(params), "
    "jl.flax.TrainState.create(..., tx=optimizer, loss_scale=loss_scale) or "
    "jl.flax.Optimizer(model, optimizer, wrt=..., loss_scale=loss_scale)."
  )


def _host_float(x: Any) -> float:
  """``x`` as a float, the largest value for a state replicated over devices (``pmap``)."""
  return float(np.max(np.asarray(x)))


def _same_state(a: LossScale, b: LossScale) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
    np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True)
  )


def _stays_at_one(loss_scale: LossScale) -> bool:
  """Whether every gradient carries a scale of 1 that no step, finite or not, moves."""
  one = loss_scale.gradient_scale
  if one is None or _host_float(one) != 1:
    return False
  return all(_same_state(loss_scale.adjust(jnp.array(f)), loss_scale) for f in (True, False))


def _update_norms(first: _Recorder, second: _Recorder) -> tuple[float, float]:
  """The norms of the true gradients reaching ``update`` in both runs, when comparable."""
  n1, n2 = math.sqrt(first.at_update[0]), math.sqrt(second.at_update[0])
  if not math.isfinite(n2):
    raise ValueError(
      "The step's gradients are finite at the loss scale S but not at a smaller one: something "
      "between the loss and loss_scaling's update does not scale linearly."
    )
  if n1 == 0:
    raise ValueError("The step's gradients are all zero: run the check on a batch that has some.")
  return n1, n2


def _check_returned_state(run: _Recorder, steps_before: int) -> None:
  """Refuses a step that returns the loss scaling state it was given instead of the new one.

  Only a step that returns exactly one state is checked (an NNX step updates
  its optimizer in place and returns none).
  """
  if run.returned_steps == [steps_before]:
    raise ValueError(
      "The step returns the loss scaling state it was given, not the one loss_scaling's update "
      f"returned (its steps counter stayed at {steps_before}): the loss scale never adjusts "
      "and skipped steps are not counted. Return the opt_state that tx.update returned (or "
      "the state from state.apply_gradients)."
    )


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

  When the gradients overflow at :math:`S` (a first batch at the usual
  starting scale :math:`2^{15}` often does), the check backs the scale off by
  its own rule (``adjust``), as training would by skipping steps, and runs at
  the first scale where they are finite; it fails only when the scale can go
  no lower (a fixed scale, or a dynamic one at its floor).

  With a scale of 1 that stays 1 (a :class:`~jmp_lite.NoOpLossScale`, a
  ``StaticLossScale(1.0)``) the wiring is checked all the same (with
  :math:`fS = f` in the second run), but a finding is only a warning:
  scaled and unscaled gradients coincide at a scale of 1, so the step trains
  as it should; it would not with any other loss scale.

  A step that returns a loss scaling state must return the one ``update``
  gave it (its ``steps`` counter advanced), or the scale would never adjust
  and skips would go uncounted.

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
    ValueError: naming the mistake and its fix, with the measured ratio (or
      the state returned, when it is the one given); or
      when the check cannot run (no or several loss scaling states, one inside
      another counted, ``update`` never called, gradients not finite at any
      scale the loss scale reaches, or all zero).
    TypeError: when the state holds no :class:`~jmp_lite.LossScale`.

  Warns:
    UserWarning: with a scale of 1 that stays 1, for a wiring that would be
      wrong with any other loss scale.
  """
  _check_factor(factor)
  loss_scale, steps_before = _the_loss_scale(args, kwargs)
  first, loss_scale = _fitting_run(step, args, kwargs, loss_scale)
  _check_returned_state(first, steps_before)
  second = _probe_run(step, args, kwargs, loss_scale, factor)
  _compare_runs(first, second, factor, loss_scale)


def _compare_runs(
  first: _Recorder, second: _Recorder, factor: float, loss_scale: LossScale
) -> None:
  """Refuses the step unless the second run's gradients are ``factor`` times the first's.

  With a scale of 1 that stays 1 a finding is a warning (see :func:`check_loss_scaling`).
  """
  n1, n2 = _update_norms(first, second)
  ratio = n2 / n1
  if abs(ratio / factor - 1) <= 1e-3:
    return
  message = _diagnosis(first, n1, ratio, factor)
  if not _stays_at_one(loss_scale):
    raise ValueError(message)
  # A scale of 1 forever: scaled and unscaled gradients coincide, so the step trains right; the
  # wiring is still wrong for any other loss scale.
  warnings.warn(
    f"With {type(loss_scale).__name__} this step trains as it should (a scale of 1 that stays 1: "
    f"scaled and unscaled gradients coincide), but not with any other scale: {message}",
    UserWarning,
    stacklevel=3,  # check_loss_scaling's caller
  )
