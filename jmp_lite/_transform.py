r"""Loss scaling as an Optax gradient transformation.

:func:`loss_scaling` wraps any optimizer. Its ``update`` takes the gradients of
the *scaled* loss and does, in one jitted step with no host sync:

.. math::

  g = \mathrm{cast}_{p}\big(\hat g / S_t\big), \qquad
  \text{finite} = \textstyle\bigwedge_i \mathrm{isfinite}(g_i), \qquad
  (u, s') = \begin{cases}
    \mathrm{inner}(g, s) & \text{finite} \\
    (0, s) & \text{otherwise}
  \end{cases}, \qquad
  S_{t+1} = \mathrm{adjust}(S_t, \text{finite})

where :math:`\hat g` are the scaled gradients, :math:`S_t` the loss scale that
produced them, :math:`\mathrm{cast}_p` a cast to at least fp32 (and at least
the parameter's dtype), and :math:`s` the inner optimizer's state, which keeps
its dtypes (bf16 moments of bf16 parameters are updated from fp32 gradients and
stored in bf16 again). A skipped step
leaves the inner state bit-identical (Adam's step count does not advance) and
returns zero updates, so no NaN ever reaches the parameters.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any, NamedTuple, Unpack

import jax
import jax.numpy as jnp
import optax

from jmp_lite import _tree_util
from jmp_lite._loss_scale import GradOptions, LossScale, is_loss_scale


class LossScalingState(NamedTuple):
  """State of :func:`loss_scaling`.

  Attributes:
    loss_scale: the loss scale to use for the *next* step's loss.
    inner_state: the wrapped optimizer's state.
    steps: number of ``update`` calls so far (int32).
    skipped_steps: number of steps skipped because of non-finite gradients.
    consecutive_skips: skipped steps since the last applied one.
    last_finite: whether the last step's gradients were finite.
  """

  loss_scale: LossScale
  inner_state: optax.OptState
  steps: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  last_finite: jax.Array


class _LossScaling(optax.GradientTransformationExtraArgs):
  """What :func:`loss_scaling` returns, recognised so that it is never wrapped twice."""

  __slots__ = ()


def nested_loss_scaling_message(given: str, times: int, fix: str | None = None) -> str:
  """The error for loss scaling applied ``times`` times.

  Args:
    given: what was given that applies it more than once.
    times: how many times the gradients would be unscaled.
    fix: what to do instead (default: apply it once, outermost).

  Returns:
    The message.
  """
  if fix is None:
    fix = (
      "Apply loss scaling once, outermost: jl.loss_scaling(optax.chain(..., optimizer), "
      "loss_scale), or a bare optimizer with loss_scale= in jl.flax.TrainState.create or "
      "jl.flax.Optimizer."
    )
  power = "" if times == 2 else f"^{times - 1}"
  return (
    f"{given}: the gradients would be unscaled {times} times, so every update would be "
    f"1/S{power} of what it should be. {fix}"
  )


def loss_scaling_states(tree: Any) -> list[LossScalingState]:
  """Every :class:`LossScalingState` in ``tree``, the nested ones included.

  A state inside another's ``inner_state`` (loss scaling applied twice) is
  counted too, outermost first.
  """
  found = []
  for x in _top_level_states(tree):
    found.extend([x, *loss_scaling_states(x.inner_state)])
  return found


def loss_scaling_depth(tree: Any) -> int:
  """How many loss scaling states the deepest chain of them in ``tree`` has, one inside another.

  It is how many times a gradient is unscaled at most: ``0`` with none, ``1``
  for one state or several side by side (``optax.multi_transform``), ``3``
  for ``A(B(C))``.
  """
  return max((1 + loss_scaling_depth(x.inner_state) for x in _top_level_states(tree)), default=0)


def _top_level_states(tree: Any) -> list[LossScalingState]:
  """The loss scaling states in ``tree`` that are inside no other one."""
  return [
    x for x in jax.tree.leaves(tree, is_leaf=is_loss_scaling_state) if is_loss_scaling_state(x)
  ]


def is_loss_scaling_state(x: Any) -> bool:
  """Whether ``x`` is a :class:`LossScalingState`."""
  return isinstance(x, LossScalingState)


def loss_scaling(
  inner: optax.GradientTransformation,
  loss_scale: LossScale,
  *,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it takes gradients of a scaled loss.

  Args:
    inner: the optimizer (any Optax transformation, e.g. a chain with clipping:
      clipping inside ``inner`` sees the true, unscaled gradients).
    loss_scale: the initial loss scale: any :class:`LossScale`
      (:class:`NoOpLossScale`, :class:`StaticLossScale`,
      :class:`DynamicLossScale`, :class:`LayerwiseLossScale`).
    axis_name: under ``shard_map``/``pmap``, the axis (or axes) whose devices
      must agree on skipping a step. Not needed under sharded ``jit``.

  Returns:
    A transformation whose ``update(scaled_grads, state, params=None,
    **extra_args)`` unscales, checks finiteness once, calls ``inner`` or skips,
    and adjusts the loss scale. Extra arguments (e.g. ``value=loss`` for
    ``optax.contrib.reduce_on_plateau``) are passed to ``inner``; pass the
    unscaled loss.

  Example::

    tx = jl.loss_scaling(optax.adam(1e-3), jl.DynamicLossScale(2.0 ** 15))
    opt_state = tx.init(params)
    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

  Put ``loss_scaling`` outermost (or first in a chain): transformations before
  it would see scaled gradients, and those after it see zero updates on a
  skipped step but still advance their own state. Apply it once: an ``inner``
  that applies it already (``loss_scaling(...)`` itself, refused here; a chain
  or ``MultiSteps`` containing one, refused by ``init``) would unscale the
  gradients twice. Each ``init`` copies ``loss_scale``'s arrays, so a step that
  donates one state leaves every later ``init`` its own.

  Raises:
    TypeError: for an ``inner`` that is no Optax transformation, or a
      ``loss_scale`` that is no :class:`LossScale`.
    ValueError: for an ``inner`` that applies loss scaling already.
  """
  inner = _checked_arguments(inner, loss_scale)

  def init(params):
    inner_state = _refuse_nested(inner.init(params))
    # Buffers of its own in every field: a train step may donate its state, and the loss
    # scale given here is the initial state of every later init.
    return LossScalingState(
      loss_scale=_tree_util.copy_arrays(loss_scale),
      inner_state=inner_state,
      steps=jnp.zeros((), jnp.int32),
      skipped_steps=jnp.zeros((), jnp.int32),
      consecutive_skips=jnp.zeros((), jnp.int32),
      last_finite=jnp.ones((), jnp.bool_),
    )

  def update(scaled_grads, state, params=None, **extra_args):
    grads, finite, loss_scale = state.loss_scale.unscale_and_adjust(
      scaled_grads, params, axis_name=axis_name
    )
    updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    inner_state = _tree_util.cast_like(inner_state, state.inner_state)
    # jnp.where never lets the NaN of the unselected branch through.
    updates = optax.tree_utils.tree_where(finite, updates, optax.tree.zeros_like(updates))
    inner_state = optax.tree_utils.tree_where(finite, inner_state, state.inner_state)
    return updates, LossScalingState(
      loss_scale=loss_scale,
      inner_state=inner_state,
      steps=optax.safe_increment(state.steps),
      skipped_steps=jnp.where(
        finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
      ),
      consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
      last_finite=finite,
    )

  return _LossScaling(init, update)


def _checked_arguments(inner: Any, loss_scale: Any) -> optax.GradientTransformationExtraArgs:
  """``inner`` as a transformation taking extra arguments, once the arguments are checked."""
  if isinstance(inner, optax.MultiSteps):
    inner = inner.gradient_transformation()
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      "inner must be an optax.GradientTransformation (or optax.MultiSteps), got "
      f"{type(inner).__name__}."
    )
  if not is_loss_scale(loss_scale):
    raise TypeError(
      "loss_scale must be a jmp_lite.LossScale (NoOpLossScale, StaticLossScale, "
      "DynamicLossScale, LayerwiseLossScale, or a type of your own defining the contract's "
      "methods scale, unscale, adjust, value_and_grad and unscale_and_adjust), got "
      f"{reprlib.repr(loss_scale)} of type {type(loss_scale).__name__}."
    )
  if isinstance(inner, _LossScaling):
    raise ValueError(
      nested_loss_scaling_message(
        "jl.loss_scaling was given inner=jl.loss_scaling(...), which already applies it", 2
      )
    )
  return optax.with_extra_args_support(inner)


def _refuse_nested(inner_state: Any) -> Any:
  """``inner_state``, if it holds no loss scaling state of its own (a chain, ``MultiSteps``)."""
  nested = len(loss_scaling_states(inner_state))
  if nested:
    raise ValueError(
      nested_loss_scaling_message(
        "jl.loss_scaling's inner optimizer already applies loss scaling (its state holds "
        f"{nested} LossScalingState)",
        loss_scaling_depth(inner_state) + 1,
      )
    )
  return inner_state


def get_loss_scaling_state(opt_state: Any) -> LossScalingState:
  """Finds the (single) :class:`LossScalingState` inside an optimizer state.

  Args:
    opt_state: the state of :func:`loss_scaling`, or any state containing it:
      ``optax.chain`` tuples, ``MultiSteps``, ``inject_hyperparams`` and any
      other pytree nesting.

  Returns:
    The :class:`LossScalingState`.

  Raises:
    ValueError: if there is none, or more than one (one inside another
      counts: loss scaling applied twice).
  """
  found = loss_scaling_states(opt_state)
  if not found:
    raise ValueError(
      f"Found no loss_scaling states in the optimizer state of type {type(opt_state).__name__}; "
      "expected exactly one. Build the optimizer with jl.loss_scaling(inner, loss_scale) and "
      "pass its state."
    )
  if len(found) > 1:
    raise ValueError(
      f"Found {len(found)} loss_scaling states in the optimizer state of type "
      f"{type(opt_state).__name__}; expected exactly one. Loss scaling applied more than once "
      "(nested, or side by side) unscales the gradients more than once: build the optimizer "
      "with a single jl.loss_scaling(inner, loss_scale), outermost."
    )
  return found[0]


def get_loss_scale(opt_state: Any) -> LossScale:
  """Returns the current loss scale held in an optimizer state.

  Args:
    opt_state: the state of :func:`loss_scaling` itself or any state
      containing it (a chain, ``MultiSteps``, a Flax ``TrainState.opt_state``...).
      A loss scale passed directly is returned as is.

  Returns:
    The :class:`LossScale` to scale the next step's loss with.

  Raises:
    ValueError: if ``opt_state`` holds no (or more than one) loss scaling state.
  """
  if is_loss_scale(opt_state):
    return opt_state
  return get_loss_scaling_state(opt_state).loss_scale


def scaled_value_and_grad(
  fun: Callable[..., Any], loss_scale: Any, **options: Unpack[GradOptions]
) -> Callable[..., tuple[Any, Any]]:
  """Like :func:`jax.value_and_grad`, differentiating ``loss_scale * fun``.

  Args:
    fun: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``).
    loss_scale: a loss scale, or an optimizer state containing one (see
      :func:`get_loss_scale`).
    **options: ``has_aux``, ``argnums``, ``value_and_grad``
      (:class:`GradOptions`), passed to the loss scale's
      :meth:`~LossScale.value_and_grad`. With
      ``value_and_grad=eqx.filter_value_and_grad``, the floating-point arrays
      of an Equinox module are differentiated and its other leaves
      (functions, integers) left alone.

  Returns:
    A function with ``fun``'s signature returning ``(value, scaled_grads)``:
    ``value`` is the *unscaled* loss (or ``(loss, aux)``); ``scaled_grads`` (a
    :class:`ScaledGrads` in its packed form: the bare gradient tree for the
    kinds with one scale) go straight into the :func:`loss_scaling`
    transformation's ``update``, which unscales them.

  Raises:
    TypeError: when a differentiated leaf is not a floating-point array
      (``jax.value_and_grad`` of an Equinox module's functions or integers):
      the error names each such leaf by its path; for a keyword that is no
      :class:`GradOptions` field.
  """
  return get_loss_scale(loss_scale).value_and_grad(fun, **options)
