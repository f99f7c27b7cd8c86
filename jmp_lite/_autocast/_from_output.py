"""fp32 operations whose derivative is a function of their result, kept lean.

For ``y = exp(x)`` (and ``logistic``) the derivative needs only ``y``. Computed in fp32 from
a 16-bit ``x``, the program uses ``y`` twice: unrounded by fp32 consumers (the softmax's sum)
and rounded once to 16 bits by the others. The rule below returns both, and differentiates
from the rounded ``y``: the backward pass keeps one 16-bit array, the one the 16-bit
consumers keep anyway, instead of the operand and the result.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jmp_lite import _compat

_F32 = np.dtype(np.float32)

DERIVATIVES = {
  "exp": lambda y: y,
  "logistic": lambda y: y * (1 - y),
}
"""Primitive name -> its derivative as a function of its result."""


def wide_and_narrow(primitive: Any, params: dict, x: Any) -> tuple[Any, Any]:
  """``primitive(x)`` in fp32 and rounded to ``x``'s 16-bit dtype, differentiated from the latter.

  Args:
    primitive: a primitive named in :data:`DERIVATIVES`.
    params: its bind parameters.
    x: the 16-bit operand.

  Returns:
    ``(fp32 result, 16-bit result)``.
  """
  narrow = x.dtype
  derivative = DERIVATIVES[primitive.name]

  @jax.custom_jvp
  def both(x):
    (y,) = _compat.bind(primitive, params, x.astype(_F32))
    return y, y.astype(narrow)

  @both.defjvp
  def both_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y, rounded = both(x)
    dy = derivative(rounded) * t.astype(narrow)
    return (y, rounded), (dy.astype(_F32), dy)

  return both(x)
