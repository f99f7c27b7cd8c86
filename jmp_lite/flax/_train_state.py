"""Flax's ``TrainState`` with a precision policy and loss scaling built in.

The usual linen training step keeps its shape; only ``create`` and the
gradient call change::

  state = jl.flax.TrainState.create(
      apply_fn=model.apply,                 # wrapped with the policy
      params=params,                        # fp32 master weights
      tx=optax.adamw(1e-3),                 # wrapped with jl.loss_scaling
      policy="params=float32,compute=float16,output=float32",
      loss_scale=jl.DynamicLossScale(2.0 ** 15),
  )

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)  # fp16 inside, fp32 logits
      return cross_entropy(logits, y)
    loss, grads = state.value_and_grad(loss_fn)(state.params)  # grads of the scaled loss
    return state.apply_gradients(grads=grads), loss  # unscale, skip on overflow, adjust

``apply_gradients`` is Flax's: it calls ``tx.update``, which is
:func:`jmp_lite.loss_scaling`'s, so a step with non-finite gradients leaves the
parameters and the inner optimizer state unchanged and lowers the scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state

from jmp_lite._loss_scale import LossScale, NoOpLossScale
from jmp_lite._policy import Policy
from jmp_lite._transform import (
  LossScalingState,
  get_loss_scale,
  get_loss_scaling_state,
  scaled_value_and_grad,
)
from jmp_lite.flax._linen import policy_apply
from jmp_lite.flax._module_policy import ModulePolicies, as_module_policies
from jmp_lite.flax._state import has_loss_scaling, mean_over, with_loss_scaling


class TrainState(train_state.TrainState):
  """:class:`flax.training.train_state.TrainState` plus a policy and loss scaling.

  Subclass it as you would Flax's (e.g. add ``batch_stats: Any``).

  Attributes:
    policy: the precision policy ``apply_fn`` runs under (``None`` if
      ``apply_fn`` was passed already wrapped, or no policy is used).
    axis_name: the data-parallel axis the gradients are averaged over, and
      whose devices agree on skipping a step (``None``: none).
  """

  # Keyword-only, so a subclass may add fields without defaults (``batch_stats: Any``).
  policy: Policy | None = struct.field(pytree_node=False, default=None, kw_only=True)
  axis_name: Any = struct.field(pytree_node=False, default=None, kw_only=True)

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any],
    params: Any,
    tx: optax.GradientTransformation,
    policy: ModulePolicies | Policy | str | None = None,
    loss_scale: LossScale | None = None,
    axis_name: Any = None,
    **kwargs: Any,
  ) -> TrainState:
    """Creates the state: ``step=0`` and the optimizer state for ``params``.

    Args:
      apply_fn: ``model.apply`` of a linen model. With ``policy``, it is
        replaced by :func:`~jmp_lite.flax.policy_apply` of that model.
      params: the parameters, stored in the policy's param dtype (cast if
        needed, so the optimizer state matches).
      tx: the optimizer, wrapped in :func:`jmp_lite.loss_scaling` with
        ``loss_scale`` (pass it unwrapped); or one that applies
        ``jl.loss_scaling`` itself, with ``loss_scale=None``.
      policy: the precision policy: a :class:`~jmp_lite.flax.ModulePolicies`
        (with its overrides and options), or a :class:`~jmp_lite.Policy` or
        policy string.
      loss_scale: the initial loss scale, e.g. ``jl.DynamicLossScale(2.0 ** 15)``
        for fp16. ``None`` is ``jl.NoOpLossScale()`` (no scaling, which bf16
        needs; non-finite steps are still skipped and counted), unless ``tx``
        applies loss scaling itself: it is then used as it is.
      axis_name: under ``pmap``/``shard_map``, the data-parallel axis:
        :meth:`value_and_grad` averages the gradients over its devices and
        they agree on skipping a step (see :func:`jmp_lite.loss_scaling`), so
        a step needs no hand-written ``pmean``. Not needed under sharded ``jit``.
      **kwargs: further fields of a subclass (e.g. ``batch_stats``).

    Returns:
      The state, its ``policy`` the :class:`~jmp_lite.Policy` ``apply_fn``
      runs under (``None`` without ``policy``).

    Raises:
      TypeError: if ``policy`` is given but ``apply_fn`` is not ``model.apply``
        of a linen module.
      ValueError: for a ``loss_scale`` with a ``tx`` that already applies loss
        scaling (the gradients would be unscaled twice).
    """
    base_policy = None
    if policy is not None:
      policies = as_module_policies(policy, "TrainState.create")
      module = getattr(apply_fn, "__self__", None)
      if not (
        isinstance(module, nn.Module) and getattr(apply_fn, "__func__", None) is nn.Module.apply
      ):
        raise TypeError(
          "With policy=..., pass apply_fn=model.apply of a flax.linen module (got "
          f"{apply_fn!r}); or wrap it yourself with jmp_lite.flax.policy_apply and omit policy."
        )
      apply_fn = policy_apply(module, policies)
      base_policy = policies.policy
      params = base_policy.cast_to_param(params)
    tx = with_loss_scaling(
      tx, loss_scale, params, axis_name=axis_name, caller="jl.flax.TrainState.create"
    )
    state = super().create(
      apply_fn=apply_fn, params=params, tx=tx, policy=base_policy, axis_name=axis_name, **kwargs
    )
    # Flax starts from the Python int 0; the first jitted step would return an
    # int32 array and the second call would compile the step again.
    return state.replace(step=jnp.zeros((), jnp.int32))

  @property
  def loss_scaling_state(self) -> LossScalingState:
    """The :class:`~jmp_lite.LossScalingState` in ``opt_state``.

    Its ``skipped_steps``, ``consecutive_skips`` and ``last_finite`` are the
    counters to log (a state from :meth:`create` always has them, with
    ``loss_scale=None`` too).

    Raises:
      ValueError: if ``opt_state`` holds none (a state not built by
        :meth:`create`), or more than one.
    """
    return get_loss_scaling_state(self.opt_state)

  @property
  def loss_scale(self) -> LossScale:
    """The current loss scale (``NoOpLossScale()`` without loss scaling)."""
    if not has_loss_scaling(self.opt_state):
      return NoOpLossScale()
    return get_loss_scale(self.opt_state)

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Flax's ``apply_gradients``; a skipped step also keeps ``kwargs``' old values.

    With loss scaling, a step whose gradients are not finite changes neither
    ``params`` nor ``opt_state``'s inner state; the collections passed as
    ``kwargs`` (``batch_stats=`` computed in that step's forward pass) are then
    kept as they were too, so no NaN reaches the running statistics.

    Args:
      grads: the gradients of the *scaled* loss (from :meth:`value_and_grad`).
      **kwargs: other fields to replace, as for Flax's ``apply_gradients``.

    Returns:
      The new state: ``step`` advanced by one (skipped steps included).
    """
    new = super().apply_gradients(grads=grads, **kwargs)
    if not kwargs or not has_loss_scaling(self.opt_state):
      return new
    finite = get_loss_scaling_state(new.opt_state).last_finite
    kept = {
      name: jax.tree.map(
        lambda n, o: jnp.where(finite, n, o) if isinstance(n, jax.Array | np.ndarray) else n,
        getattr(new, name),
        getattr(self, name),
      )
      for name in kwargs
    }
    return new.replace(**kept)

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int | tuple[int, ...] = 0,
  ) -> Callable[..., tuple[Any, Any]]:
    """:func:`jax.value_and_grad` of ``fun`` times the current loss scale.

    Args:
      fun: the loss function, e.g. of the parameters.
      has_aux: as for :func:`jax.value_and_grad`: ``fun`` returns ``(loss, aux)``.
      argnums: as for :func:`jax.value_and_grad`.

    Returns:
      A function with ``fun``'s signature giving ``(value, grads)``: ``value``
      is ``fun``'s own (unscaled) value, ``grads`` are the gradients of the
      *scaled* loss, which :meth:`apply_gradients` expects (averaged over
      ``axis_name``'s devices when the state has one).
    """
    grad_fn = scaled_value_and_grad(fun, self.loss_scale, has_aux=has_aux, argnums=argnums)

    def averaged(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
      value, grads = grad_fn(*args, **kwargs)
      loss = value[0] if has_aux else value
      return value, mean_over(grads, loss, self.axis_name)

    return averaged
