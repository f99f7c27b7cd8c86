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

import jax
import optax
from flax import nnx

from jmp_lite import _validation
from jmp_lite._loss_scale import LossScale, NoOpLossScale, select_tree
from jmp_lite._transform import LossScalingState, get_loss_scaling_state
from jmp_lite.flax._state import has_loss_scaling, mean_over, with_loss_scaling

M = TypeVar("M", bound=nnx.Module)


class Optimizer(nnx.Optimizer[M]):
  """:class:`flax.nnx.Optimizer` whose transformation is wrapped in loss scaling.

  Args:
    model: the NNX model.
    tx: the optimizer, wrapped in :func:`jmp_lite.loss_scaling` with
      ``loss_scale`` (pass it unwrapped); or one that applies
      ``jl.loss_scaling`` itself, with ``loss_scale=None``.
    wrt: which Variables to optimize, as for :class:`flax.nnx.Optimizer`
      (usually ``nnx.Param``); also what :meth:`value_and_grad`
      differentiates.
    loss_scale: the initial loss scale, e.g. ``jl.DynamicLossScale(2.0 ** 15)``
      for fp16. ``None`` is ``jl.NoOpLossScale()`` (no scaling; non-finite
      steps are still skipped and counted), unless ``tx`` applies loss scaling
      itself: it is then used as it is. A ``loss_scale`` with such a ``tx`` is
      refused (ValueError): the gradients would be unscaled twice.
    axis_name: under ``shard_map``/``pmap``, the data-parallel axis:
      :meth:`value_and_grad` averages the gradients over its devices and
      they agree on skipping a step (see :func:`jmp_lite.loss_scaling`), so
      a step needs no hand-written ``pmean``. Not needed under sharded ``jit``.
    graph: as for :class:`flax.nnx.Optimizer`.
  """

  def __init__(
    self,
    model: M,
    tx: optax.GradientTransformation,
    *,
    wrt: Any,
    loss_scale: LossScale | None = None,
    axis_name: Any = None,
    graph: bool | None = None,
  ):
    tx = with_loss_scaling(
      tx,
      loss_scale,
      nnx.state(model, wrt, graph=graph),
      axis_name=axis_name,
      caller="jl.flax.Optimizer",
    )
    super().__init__(model, tx, wrt=wrt, graph=graph)
    self.axis_name = axis_name

  @property
  def loss_scaling_state(self) -> LossScalingState:
    """The :class:`~jmp_lite.LossScalingState` (as plain arrays): scale and counters to log.

    Present with ``loss_scale=None`` too (a scale of 1).

    Raises:
      ValueError: if ``opt_state`` holds none (replaced by hand), or more than one.
    """
    # NNX stores optimizer state leaves as OptState Variables; as_pure gives arrays.
    return get_loss_scaling_state(nnx.as_pure(self.opt_state))

  @property
  def loss_scale(self) -> LossScale:
    """The current loss scale (``NoOpLossScale()`` without loss scaling)."""
    if not self._has_loss_scaling:
      return NoOpLossScale()
    return self.loss_scaling_state.loss_scale

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int = 0,
  ) -> Callable[..., tuple[Any, Any]]:
    """:func:`flax.nnx.value_and_grad` of ``fun`` times the current loss scale.

    Differentiates argument ``argnums`` (a model) with respect to this
    optimizer's ``wrt`` Variables, through the loss scale's
    :meth:`~jmp_lite.LossScale.value_and_grad` (so layer-wise scales activate
    their stage boundaries).

    A step whose gradients are not finite will be skipped by :meth:`update`;
    the forward pass's writes to the model's other Variables (``BatchStat``
    running statistics, counters; not ``RngState``) are then undone here, so a
    skipped step leaves the whole model as it was.

    Args:
      fun: the loss function of the model (and other arguments).
      has_aux: ``fun`` returns ``(loss, aux)``.
      argnums: the position of the model among ``fun``'s arguments.

    Returns:
      A function with ``fun``'s signature giving ``(value, grads)``: ``value``
      unscaled (``(loss, aux)`` with ``has_aux``), ``grads`` the gradients of
      the scaled loss, which :meth:`update` expects.

    Raises:
      TypeError: if ``argnums`` is not an int.
    """
    argnums = _validation.check_int(argnums, "argnums", None)  # negative counts from the end
    scale = self.loss_scale
    scaled_grad_fn = scale.value_and_grad(
      fun,
      has_aux=has_aux,
      argnums=nnx.DiffState(argnums, self.wrt),
      value_and_grad=nnx.value_and_grad,
    )

    def grad_fn(*args, **kwargs):
      value, grads = scaled_grad_fn(*args, **kwargs)
      loss = value[0] if has_aux else value
      return value, mean_over(grads, loss, self.axis_name)

    if not self._has_loss_scaling:
      return grad_fn  # no step is ever skipped
    written = nnx.All(nnx.Not(self.wrt), nnx.Not(nnx.RngState))

    def value_and_scaled_grad(*args, **kwargs):
      model = args[argnums]
      before = nnx.as_pure(nnx.state(model, written))
      value, grads = grad_fn(*args, **kwargs)
      if not jax.tree.leaves(before):
        return value, grads
      # The same computation as update()'s tx.update, so the two agree exactly
      # (in one jit XLA computes it once: the optimized HLO has no extra reduction).
      params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
      _, finite, _ = scale.unscale_and_adjust(
        self._pure_grads(grads), params, axis_name=self.axis_name
      )
      nnx.update(model, select_tree(finite, nnx.as_pure(nnx.state(model, written)), before))
      return value, grads

    return value_and_scaled_grad

  def update(self, model: M, grads: Any, /, **kwargs: Any) -> optax.Updates:
    """Applies ``grads`` from :meth:`value_and_grad` (unscale, skip on overflow, adjust).

    As :meth:`flax.nnx.Optimizer.update`; ``grads`` are what
    :meth:`value_and_grad` returned, in any loss scale's form (a
    :class:`~jmp_lite.ScaledGrads` or the bare gradient tree).

    Args:
      model: the model the optimizer was built for; its ``wrt`` Variables are
        updated in place.
      grads: the gradients of the scaled loss.
      **kwargs: extra arguments of ``tx.update`` (e.g. ``value=`` for
        line-search optimizers).

    Returns:
      The updates applied (zero on a skipped step).
    """
    param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    updates, new_opt_state = self.tx.update(
      self._pure_grads(grads), nnx.as_pure(self.opt_state), param_arrays, **nnx.as_pure(kwargs)
    )
    nnx.update(model, optax.apply_updates(param_arrays, updates))
    nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
    self.step[...] += 1
    return updates

  @property
  def _has_loss_scaling(self) -> bool:
    return has_loss_scaling(nnx.as_pure(self.opt_state))

  def _pure_grads(self, grads: Any) -> Any:
    # The wrt gradients as arrays, wherever the ScaledGrads holds them.
    return jax.tree.map(
      lambda g: nnx.as_pure(nnx.state(g, self.wrt, graph=self.graph)) if _is_state(g) else g,
      grads,
      is_leaf=_is_state,
    )


def _is_state(x: Any) -> bool:
  return isinstance(x, nnx.State)
