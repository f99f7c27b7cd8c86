"""The matmul accumulation check: dot products rounded to a narrow result type.

A jaxpr states one accumulation type for a ``dot_general``/convolution: its
result type (or a ``DotAlgorithmPreset``'s). XLA accumulates float16/bfloat16
dot products in float32 on CPU, GPU and TPU, so by default
(``matmul_accumulation="assume_fp32"``) only fp8 results are reported;
``"as_written"`` trusts the jaxpr alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _jaxpr
from jmp_lite._audit import _graph
from jmp_lite._audit._registry import Hit, Site, register

MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def _states_wide_accumulation(eqn: Any) -> bool:
  """Whether a dot's algorithm preset states an fp32 (or wider) accumulator."""
  precision = eqn.params.get("precision")
  if not isinstance(precision, lax.DotAlgorithmPreset):
    return False
  accumulation = precision.accumulation_type
  return accumulation is not None and np.dtype(accumulation).itemsize >= 4


@register(
  "matmul",
  "dot_general / convolution without a wide result type",
  primitives=MATMULS,
)
def matmul(site: Site) -> Hit | None:
  """A 16/8-bit matmul whose result type is fp8 (any narrow one with ``"as_written"``)."""
  eqn, audit = site.eqn, site.audit
  lhs, rhs = eqn.invars[:2]
  in_dtype = audit.low(lhs) or audit.low(rhs)
  out_dtype = _jaxpr.dtype_of(eqn.outvars[0])
  if in_dtype is None or out_dtype is None or out_dtype not in audit.formats:
    return None
  n = _graph.contraction_size(eqn)
  info = dtypes.format_info(out_dtype)
  if audit.matmul_accumulation == "assume_fp32":
    if not dtypes.is_float8(out_dtype):
      return None
    message = (
      f"{eqn.primitive.name} with a {out_dtype.name} result: the {n}-term dot products are "
      f"rounded to {out_dtype.name} ({info.mantissa_bits} mantissa bits, max {info.max:g}). "
      "Ask for a wide result with preferred_element_type=jnp.float32 (or bfloat16) and "
      "quantize with a scale afterwards."
    )
  else:
    threshold = audit.contraction_threshold(out_dtype)
    if n < threshold or _states_wide_accumulation(eqn):
      return None
    message = (
      f"{eqn.primitive.name} accumulating {n} products with a {out_dtype.name} result type, "
      f"the only accumulation type the program states: a backend that accumulates in "
      f"{out_dtype.name} loses terms from 1/eps = {threshold} products on. State fp32 "
      "accumulation with precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32 (F16_F16_F32), "
      "as jmp_lite.flax.dot_general does on TPU, or pass "
      "preferred_element_type=jnp.float32 and cast the result."
    )
  return Hit(out_dtype, message, size=n)
