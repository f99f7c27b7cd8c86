"""What the Flax training states share (private)."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from jmp_lite._transform import get_loss_scaling_state
from jmp_lite.layerwise import LayerwiseGrads


def has_loss_scaling(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds a :class:`jmp_lite.LossScalingState`."""
  try:
    get_loss_scaling_state(opt_state)
  except ValueError:
    return False
  return True


def mean_over(grads: Any, loss: Any, axis_name: Any) -> Any:
  """The gradients averaged over the devices of ``axis_name`` (``None``: as they are).

  Under ``shard_map`` (which types values by the mesh axes they vary over), JAX
  already sums the gradient of a parameter replicated over ``axis_name`` when
  the loss varies over it: that gradient is divided by the number of devices.
  A gradient that varies (``pmap``, or ``shard_map`` with ``check_vma=False``)
  is averaged with ``pmean``. Layer-wise boundary statistics stay per device:
  the scale rule combines them over ``axis_name`` itself.
  """
  if axis_name is None:
    return grads
  if isinstance(grads, LayerwiseGrads):
    return grads._replace(grads=mean_over(grads.grads, loss, axis_name))
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  summed_by_jax = _varies(loss, names)
  devices = lax.psum(1, axis_name)
  return jax.tree.map(
    lambda g: g / devices if summed_by_jax and not _varies(g, names) else lax.pmean(g, axis_name),
    grads,
  )


def _varies(x: Any, names: tuple) -> bool:
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
  varying = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
  return any(name in varying for name in names)
