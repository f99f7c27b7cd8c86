"""What the Flax training states share (private)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax import lax

from jmp_lite import _compat
from jmp_lite._loss_scale import LossScale, NoOpLossScale, ScaledGrads
from jmp_lite._transform import (
  loss_scaling,
  loss_scaling_depth,
  loss_scaling_states,
  nested_loss_scaling_message,
)


def with_loss_scaling(
  tx: optax.GradientTransformation,
  loss_scale: LossScale | None,
  params: Any,
  *,
  axis_name: Any,
  caller: str,
) -> optax.GradientTransformation:
  """``tx`` with loss scaling applied exactly once.

  ``loss_scale=None`` means ``NoOpLossScale()`` for a bare ``tx`` (steps with
  non-finite gradients are skipped and the counters kept), and ``tx`` as it is
  when it applies loss scaling itself. A ``loss_scale`` for a ``tx`` that
  already applies it is refused: the gradients would be unscaled twice. Whether
  it does is read from its state, initialized abstractly (``jax.eval_shape``:
  no FLOPs), so a chain or ``MultiSteps`` containing ``jl.loss_scaling`` counts.
  """
  inside = loss_scaling_depth(jax.eval_shape(tx.init, params))
  if loss_scale is None:
    return tx if inside else loss_scaling(tx, NoOpLossScale(), axis_name=axis_name)
  if inside:
    raise ValueError(
      nested_loss_scaling_message(
        f"{caller} got loss_scale={type(loss_scale).__name__}(...) and a tx that already "
        "applies loss scaling (built with jl.loss_scaling)",
        inside + 1,
        "Pass one of them: the bare optimizer with loss_scale=..., or that tx with "
        "loss_scale=None.",
      )
    )
  return loss_scaling(tx, loss_scale, axis_name=axis_name)


def has_loss_scaling(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds a :class:`jmp_lite.LossScalingState`."""
  return bool(loss_scaling_states(opt_state))


def mean_over(grads: Any, loss: Any, axis_name: Any) -> Any:
  """The gradients averaged over the devices of ``axis_name`` (``None``: as they are).

  Under ``shard_map`` (which types values by the mesh axes they vary over), JAX
  already sums the gradient of a parameter replicated over ``axis_name`` when
  the loss varies over it: that gradient is divided by the number of devices.
  A gradient that varies (``pmap``, or ``shard_map`` with ``check_vma=False``)
  is averaged with ``pmean``. Only the parameter gradients of a
  :class:`~jmp_lite.ScaledGrads` are: its ``stats`` stay per device (the loss
  scale's ``unscale_and_adjust`` combines them over ``axis_name`` itself).
  """
  if axis_name is None:
    return grads
  scaled = ScaledGrads.of(grads)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  summed_by_jax = _varies(loss, names)
  devices = lax.psum(1, axis_name)
  averaged = jax.tree.map(
    lambda g: g / devices if summed_by_jax and not _varies(g, names) else lax.pmean(g, axis_name),
    scaled.grads,
  )
  return scaled._replace(grads=averaged).packed()


def _varies(x: Any, names: tuple) -> bool:
  varying = _compat.varying_axes(x)
  return any(name in varying for name in names)
