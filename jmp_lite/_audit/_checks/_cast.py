"""The cast check: values cast to float16 or fp8 that do not fit the format.

Uses the value ranges of :mod:`jmp_lite._audit._ranges`: a bounded range
beyond the format's max (a ``-1e9`` mask), a range expanded by an ``exp``, a
power or a long sum (and their means), or an fp8 cast of values with no known
bound. A Python number that already overflowed when JAX converted it to a
16/8-bit operand (``x16 + 1e5``) is reported too. Range checks apply to
formats narrower than float32's range: bfloat16 has float32's exponent.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _jaxpr
from jmp_lite._audit._registry import Hit, Site, narrow_range, register


@register(
  "cast",
  "cast to float16 / fp8 of values beyond the format's range",
  primitives={"convert_element_type", "add", "sub", "mul", "div"},
)
def cast(site: Site) -> Hit | None:
  """A cast to float16/fp8 of values that can exceed its range, or an overflowed constant."""
  if site.eqn.primitive.name == "convert_element_type":
    return _cast_out_of_range(site)
  return _overflowed_literal(site)


def _cast_out_of_range(site: Site) -> Hit | None:
  eqn = site.eqn
  dst = site.audit.low(eqn.outvars[0])
  src = _jaxpr.dtype_of(eqn.invars[0])
  if dst is None or src is None or not jnp.issubdtype(src, jnp.floating):
    return None
  dst_info, src_info = dtypes.format_info(dst), jnp.finfo(src)
  if 2 * dst_info.max > float(src_info.max):
    return None  # the same exponent range: float32 -> bfloat16 loses precision, not range
  r = site.ranges[0]
  overflow = "NaN" if dst.name.endswith("fn") else "inf"
  if r.bounded:  # both ends known: from constants and bounded operations
    if r.magnitude <= dst_info.max:
      return None
    exact = " (a constant)" if r.lo == r.hi else ""
    return Hit(
      dst,
      f"cast from {src.name} to {dst.name} of values reaching magnitude {r.magnitude:.3g}"
      f"{exact}, beyond {dst.name}'s max {dst_info.max:g}: they become {overflow}. A mask "
      f"value such as -1e9 must be jnp.finfo({dst.name}).min (or -inf) in 16 bits.",
    )
  if r.expanded_by is not None:
    return Hit(
      dst,
      f"cast from {src.name} to {dst.name} of the result of {r.expanded_by}, which can "
      f"exceed {dst.name}'s max {dst_info.max:g} (it would become {overflow}). Keep the "
      "value in float32, or normalize/clip it before the cast.",
    )
  if dtypes.is_float8(dst):
    return Hit(
      dst,
      f"cast from {src.name} to {dst.name} of values with no known bound: {dst.name} holds "
      f"magnitudes up to {dst_info.max:g} and larger ones become {overflow}. Scale the "
      f"tensor (delayed scaling) and clip it to +-{dst_info.max:g} before the cast.",
    )
  return None


def _overflowed_literal(site: Site) -> Hit | None:
  eqn = site.eqn
  for atom in eqn.invars:
    if not _jaxpr.is_literal(atom):
      continue
    dtype = site.audit.low(atom)
    if dtype is None or not narrow_range(dtype):
      continue
    value = np.asarray(atom.val, np.float64)
    if np.isinf(value).any():
      return Hit(
        dtype,
        f"{eqn.primitive.name} with the constant {float(value.flat[0])} in {dtype.name}: a "
        f"Python number beyond {dtype.name}'s max {dtypes.format_info(dtype).max:g} (e.g. "
        f"1e5) overflowed to inf when JAX converted it to {dtype.name}. Use a representable "
        "value or compute in float32.",
      )
  return None
