"""The autocast op table: which dtype each primitive runs in under a 16-bit policy.

A rule names how an equation's floating operands are read:

* ``"compute"``: cast to the policy's compute dtype (matmuls and convolutions;
  the result keeps the dtype the program gives it, through
  ``preferred_element_type``);
* ``"float32"``: widened to fp32 (the fp32 value a previous fp32 operation
  produced is read directly, unrounded);
* ``"input"``: read at the dtypes the program gives them (JAX has already
  promoted mixed operands to the widest: elementwise operations, comparisons,
  ``reduce_max``...). The default for a primitive the table does not list;
* ``"cast"``: a ``convert_element_type`` the user wrote; its ``new_dtype`` is
  kept, converting from the unrounded fp32 value where there is one;
* ``"sum_grad_float32"``: as ``"input"``, but the gradient of a 16-bit operand the
  equation broadcasts (``broadcast_in_dim``; the size-1 axes an ``add``, ``sub`` or
  ``mul`` broadcasts), a sum of the cotangent over the broadcast axes, is summed in fp32.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Mapping
from typing import Any

from jmp_lite import _compat

RULES = ("compute", "float32", "input", "cast", "sum_grad_float32")

# Primitives whose derivative needs no value of their operands (linear): widened
# without recomputation. The other fp32 primitives are recomputed in the backward
# pass from their 16-bit operands (see ``_interpret``).
LINEAR = frozenset({"reduce_sum", "cumsum"})

# A broadcast, and the elementwise operations that broadcast size-1 axes of their operands.
_BROADCASTING = ("broadcast_in_dim", "add", "add_any", "sub", "mul")

_DEFAULT = {
  # torch.autocast: "lower precision" (matmul, conv*, bmm, baddbmm, linear)
  "dot_general": "compute",
  "conv_general_dilated": "compute",
  # torch.autocast: "float32" (exp, log, log1p, expm1, pow, rsqrt, sqrt?, erfinv, sigmoid
  # in its list via binary_cross_entropy / softplus, softmax, log_softmax, logsumexp, sum,
  # prod, cumsum, cumprod, norms)
  "exp": "float32",
  "exp2": "float32",
  "log": "float32",
  "log1p": "float32",
  "expm1": "float32",
  "pow": "float32",
  "rsqrt": "float32",
  "sqrt": "float32",
  "erf_inv": "float32",
  "logistic": "float32",
  "reduce_sum": "float32",
  "reduce_prod": "float32",
  "cumsum": "float32",
  "cumprod": "float32",
  "cumlogsumexp": "float32",
  # torch.autocast: not listed (they run in their input dtype)
  "reduce_max": "input",
  "reduce_min": "input",
  "cummax": "input",
  "cummin": "input",
  # the user's own casts
  "convert_element_type": "cast",
  # torch.autocast: not listed (the gradient of a broadcast, a sum, runs in the cotangent's
  # dtype): a bias, a norm's scale, a keepdims statistic
  **dict.fromkeys(_BROADCASTING, "sum_grad_float32"),
}

AUTOCAST_TABLE: Mapping[str, str] = types.MappingProxyType(_DEFAULT)
"""The default op table: primitive name -> rule (``"compute"``, ``"float32"``, ``"input"``,
``"cast"``); a primitive it does not list runs at its input dtypes (``"input"``)."""


def check_table(table: Any, name: str) -> dict[str, str]:
  """``table`` as a dict, checked.

  Args:
    table: a mapping of primitive names to rules.
    name: the argument's name, for errors.

  Returns:
    A copy of ``table``.

  Raises:
    TypeError: if ``table`` is not a mapping of strings.
    ValueError: for a rule that is not one of :data:`RULES`.

  A primitive name JAX does not define (nor the default table) is warned about: a
  misspelled name would otherwise change nothing.
  """
  if not isinstance(table, Mapping):
    raise TypeError(f"{name} must be a mapping of primitive names to rules, got {table!r}.")
  out = {}
  for primitive, rule in table.items():
    if not isinstance(primitive, str):
      raise TypeError(f"{name}: primitive names are strings, got {primitive!r}.")
    if rule not in RULES:
      raise ValueError(
        f"{name}[{primitive!r}] = {rule!r} is not a rule; accepted: {', '.join(RULES)}."
      )
    if primitive not in _DEFAULT and primitive not in _jax_primitive_names():
      warnings.warn(
        f"{name}[{primitive!r}]: JAX has no primitive of that name (a misspelling?); the rule "
        "applies only if a primitive so named (one of your own) runs.",
        UserWarning,
        stacklevel=3,
      )
    out[primitive] = rule
  return out


@functools.cache
def _jax_primitive_names() -> frozenset[str]:
  return _compat.primitive_names()
