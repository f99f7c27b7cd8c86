"""Flax NNX's ``Optimizer`` with loss scaling built in.

The usual NNX training step keeps its shape; the policy comes in through
:func:`~jmp_lite.flax.policy_view` and the loss scale through the optimizer::

  policy = jl.get_policy("params=float32,compute=float16,output=float32")
  optimizer = jl.flax.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param,
                                loss_scale=jl.DynamicLossScale(2.0 ** 15))

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return cross_entropy(jl.flax.policy_view(model, policy)(x), y)
    loss, grads = optimizer.value_and_grad(loss_fn)(model)  # grads of the scaled loss
    optimizer.update(model, grads)  # unscale, skip on overflow, adjust the scale
    return loss

``update`` is NNX's: it calls ``tx.update``, which is
:func:`jmp_lite.loss_scaling`'s, so on overflow neither the parameters nor the
inner optimizer state change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import optax
from flax import nnx

from jmp_lite.loss_scale import LossScale, NoOpLossScale
from jmp_lite.transform import LossScalingState, get_loss_scaling_state, loss_scaling

M = TypeVar("M", bound=nnx.Module)


class Optimizer(nnx.Optimizer[M]):
  """:class:`flax.nnx.Optimizer` whose transformation is wrapped in loss scaling.

  Args:
    model: the NNX model.
    tx: the optimizer; with ``loss_scale`` it is wrapped in
      :func:`jmp_lite.loss_scaling` (pass it unwrapped).
    wrt: which Variables to optimize, as for :class:`flax.nnx.Optimizer`
      (usually ``nnx.Param``); also what :meth:`value_and_grad`
      differentiates.
    loss_scale: the initial loss scale, e.g. ``jl.DynamicLossScale(2.0 ** 15)``
      for fp16; ``None`` for none (``tx`` is then used as is).
    graph: as for :class:`flax.nnx.Optimizer`.
  """

  def __init__(
    self,
    model: M,
    tx: optax.GradientTransformation,
    *,
    wrt: Any,
    loss_scale: LossScale | None = None,
    graph: bool | None = None,
  ):
    if loss_scale is not None:
      tx = loss_scaling(tx, loss_scale)
    super().__init__(model, tx, wrt=wrt, graph=graph)

  @property
  def loss_scaling_state(self) -> LossScalingState:
    """The loss scaling state (as plain arrays): scale and skip counters to log.

    Raises ``ValueError`` if the optimizer has no loss scaling.
    """
    # NNX stores optimizer state leaves as OptState Variables; as_pure gives arrays.
    return get_loss_scaling_state(nnx.as_pure(self.opt_state))

  @property
  def loss_scale(self) -> LossScale:
    """The current loss scale (``NoOpLossScale()`` without loss scaling)."""
    try:
      return self.loss_scaling_state.loss_scale
    except ValueError:
      return NoOpLossScale()

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int = 0,
  ) -> Callable[..., tuple[Any, Any]]:
    """:func:`flax.nnx.value_and_grad` of ``fun`` times the current loss scale.

    Differentiates argument ``argnums`` (a model) with respect to this
    optimizer's ``wrt`` Variables. Returns a function with ``fun``'s signature
    giving ``(value, grads)``: ``value`` unscaled (``(loss, aux)`` with
    ``has_aux``), ``grads`` the gradients of the scaled loss, which
    :meth:`update` expects.
    """
    if isinstance(argnums, bool) or not isinstance(argnums, int):
      raise TypeError(f"argnums must be an int (the position of the model), got {argnums!r}.")
    scale = self.loss_scale

    def scaled(*args, **kwargs):
      out = fun(*args, **kwargs)
      value, aux = out if has_aux else (out, None)
      return scale.scale(value), (value, aux)

    grad_fn = nnx.value_and_grad(scaled, argnums=nnx.DiffState(argnums, self.wrt), has_aux=True)

    def value_and_scaled_grad(*args, **kwargs):
      (_, (value, aux)), grads = grad_fn(*args, **kwargs)
      return ((value, aux) if has_aux else value), grads

    return value_and_scaled_grad
