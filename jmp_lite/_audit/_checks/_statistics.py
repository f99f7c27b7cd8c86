r"""Checks of sums and the statistics made from them: long reductions, normalization, division.

A sum of :math:`n` values accumulated in a format with machine epsilon
:math:`\epsilon` stops growing by terms smaller than :math:`\epsilon` times
the running sum: from :math:`n = 1/\epsilon` values on (128 for bfloat16, 1024
for float16) a sequential accumulation drops terms. That length is
``AuditConfig.long_reduction``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite._audit import _graph
from jmp_lite._audit._registry import Hit, Site, narrow_range, register


@register(
  "reduction",
  "sum, product or cumulative sum in 16/8 bits over a long axis: at least long_reduction "
  "values (default 1/eps of the format)",
  primitives=_graph.ACCUMULATING,
)
def reduction(site: Site) -> Hit | None:
  """A 16/8-bit sum, product or cumulative op over ``long_reduction`` values or more."""
  eqn = site.eqn
  dtype = site.audit.low(eqn.invars[0])
  if dtype is None:
    return None
  n = _graph.reduced_size(eqn)
  threshold = site.audit.reduction_threshold(dtype)
  if n < threshold:
    return None
  info = dtypes.format_info(dtype)
  prefix = "every prefix of " if eqn.primitive.name.startswith("cum") else ""
  return Hit(
    dtype,
    f"{eqn.primitive.name} over {n} values in {dtype.name}: from 1/eps = {threshold} values "
    "on, each term is smaller than the rounding error of the running sum, so a sequential "
    f"accumulation drops terms ({prefix}the result is accurate to ~{min(n * info.epsilon, 1):.2g}"
    " relative at worst); XLA may accumulate in a wider type but is not required to. "
    "Accumulate in float32: x.astype(jnp.float32).sum(...) or jnp.sum(x, dtype=jnp.float32).",
    size=n,
  )


@register(
  "normalization",
  "variance / RMS statistics or rsqrt of a reduction in 16/8 bits",
  primitives={"square", "integer_pow", "mul", "rsqrt", "sqrt"},
)
def normalization(site: Site) -> Hit | None:
  """``x**2`` feeding a sum in a narrow-range format, or ``rsqrt``/``sqrt`` of a reduction."""
  if site.eqn.primitive.name in ("rsqrt", "sqrt"):
    return _root_of_statistics(site)
  return _square_into_sum(site)


def _square_into_sum(site: Site) -> Hit | None:
  eqn, graph = site.eqn, site.graph
  name = eqn.primitive.name
  if name == "integer_pow" and eqn.params.get("y") != 2:
    return None
  if name == "mul" and eqn.invars[0] is not eqn.invars[1]:
    return None
  dtype = site.audit.low(eqn.outvars[0])
  if dtype is None or not narrow_range(dtype):
    return None
  sums = graph.consumers_of(graph.forward(eqn.outvars[0]), {"reduce_sum", "cumsum"})
  red = next(sums, None)
  if red is None:
    return None
  info = dtypes.format_info(dtype)
  return Hit(
    dtype,
    f"x**2 in {dtype.name} feeding a sum (variance / RMS statistics) overflows to inf "
    f"for |x| > {math.sqrt(info.max):.0f}, making the statistics inf or NaN. Square "
    "and reduce in float32 (flax.linen.LayerNorm and RMSNorm compute statistics in "
    "float32 by default).",
    size=_graph.reduced_size(red),
  )


def _of_statistics(site: Site, value: Any, statistic: Any) -> tuple[np.dtype, Any, list] | None:
  """``(dtype, reduction, chain)`` when ``value`` is 16/8-bit and ``statistic`` comes from a
  reduction (see :func:`~jmp_lite._audit._graph.reduction_origin`), else None."""
  dtype = site.audit.low(value)
  if dtype is None:
    return None
  red, chain = _graph.reduction_origin(site.audit.graphs, site.graph, statistic)
  return None if red is None else (dtype, red, chain)


def _root_of_statistics(site: Site) -> Hit | None:
  eqn = site.eqn
  found = _of_statistics(site, eqn.invars[0], eqn.invars[0])
  if found is None:
    return None
  dtype, red, _ = found
  info = dtypes.format_info(dtype)
  return Hit(
    dtype,
    f"{eqn.primitive.name} of a reduction (normalization statistics) in {dtype.name}: "
    f"variances below {info.min_normal:.1e} are subnormal or 0 in {dtype.name}, so "
    f"1/sqrt(var + eps) loses precision or overflows (eps itself, e.g. 1e-6, is "
    f"{'subnormal' if info.min_normal > 1e-6 else 'rounded'} there), and the result carries "
    f"~{info.epsilon:.0e} relative error. Compute mean, variance and rsqrt in float32.",
    size=_graph.reduced_size(red),
  )


@register("division", "division by a reduction in 16/8 bits", primitives={"div"})
def division(site: Site) -> Hit | None:
  """A 16/8-bit division by a sum, mean or norm (not already reported through its sqrt)."""
  found = _of_statistics(site, site.eqn.outvars[0], site.eqn.invars[1])
  if found is None:
    return None
  dtype, red, chain = found
  if any(e.primitive.name in ("sqrt", "rsqrt") and site.audit.low(e.invars[0]) for e in chain):
    return None  # the sqrt of the statistics is reported already
  info = dtypes.format_info(dtype)
  return Hit(
    dtype,
    f"division by a reduction (a sum, mean or norm) in {dtype.name}: a denominator that "
    f"rounded to 0 (below {info.min_subnormal:.1e}) gives inf/NaN, and the quotient carries "
    f"~{info.epsilon:.0e} relative error. Divide in float32.",
    size=_graph.reduced_size(red),
  )
