r"""Per-layer statistics of gradients as a target format would store them.

For a gradient :math:`g`, a loss scale :math:`S` and a format with smallest
subnormal :math:`s_{min}`, smallest normal :math:`n_{min}` and largest value
:math:`M`, each value of :math:`|gS|` is counted as zero, non-finite,
underflowing (:math:`\le s_{min}/2`: it rounds to 0), subnormal
(:math:`< n_{min}`) or overflowing (it rounds beyond :math:`M`), and binned by
the binary exponent :math:`\lfloor\log_2|g|\rfloor` of the unscaled value.
Everything is a sum or a maximum, so shards of one gradient combine exactly
(``axis_name``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _dtypes, _jaxpr
from jmp_lite._loss_scale import gradient_scale_value

DEFAULT_EXPONENT_RANGE = (-64, 16)


class GradientStats(NamedTuple):
  r"""Statistics of the gradients of one leaf or layer (a pytree of arrays).

  Fractions are of all ``size`` values. For a gradient :math:`g`, a loss scale
  :math:`S` and a target format with smallest subnormal :math:`s_{min}`,
  smallest normal :math:`n_{min}` and largest value :math:`M`:

  * ``underflow_fraction``: :math:`g \ne 0` and :math:`|gS| \le s_{min}/2`
    (rounds to 0 in the format);
  * ``subnormal_fraction``: :math:`s_{min}/2 < |gS| < n_{min}` (kept with
    fewer significant bits; flushed to 0 on hardware without subnormals);
  * ``overflow_fraction``: :math:`|gS|` rounds beyond :math:`M` (inf, or NaN
    for the ``fn`` fp8 formats); values already non-finite are counted in
    ``nonfinite_fraction`` instead.

  ``histogram`` counts the finite non-zero values by binary exponent
  :math:`e = \lfloor\log_2|g|\rfloor` of the *unscaled* input: bin 0 holds
  :math:`e < \mathrm{min\_exponent}`, bin :math:`i` holds
  :math:`e = \mathrm{min\_exponent} + i - 1`, the last bin everything from
  the top of the range up. It is empty when statistics were computed with
  ``exponent_range=None``.

  Attributes:
    size: the number of values (int32).
    zero_fraction: the fraction of values that are exactly 0.
    nonfinite_fraction: the fraction of inf and NaN values.
    underflow_fraction: see above.
    subnormal_fraction: see above.
    overflow_fraction: see above.
    max_abs: the largest finite :math:`|g|` (unscaled).
    histogram: int32 counts per exponent bin.
    min_exponent: the exponent of bin 1 (int32).
    loss_scale: :math:`S` (float32).
  """

  size: jax.Array
  zero_fraction: jax.Array
  nonfinite_fraction: jax.Array
  underflow_fraction: jax.Array
  subnormal_fraction: jax.Array
  overflow_fraction: jax.Array
  max_abs: jax.Array
  histogram: jax.Array
  min_exponent: jax.Array
  loss_scale: jax.Array

  def bin_exponents(self) -> np.ndarray:
    """The exponent of each histogram bin (host-side: reads ``min_exponent``).

    Returns:
      An int array as long as ``histogram``; the first and last bins are
      open-ended and labelled with the exponent just outside the range.
    """
    n = int(np.shape(self.histogram)[-1])
    return int(np.asarray(self.min_exponent)) - 1 + np.arange(n)


class _Counts(NamedTuple):
  size: jax.Array
  zeros: jax.Array
  nonfinite: jax.Array
  underflow: jax.Array
  subnormal: jax.Array
  overflow: jax.Array
  max_abs: jax.Array
  histogram: jax.Array


def _thresholds(info: _dtypes.FormatInfo) -> tuple[float, float, bool]:
  """(largest |x| that rounds to 0, smallest |x| that overflows, whether that
  overflow bound is inclusive)."""
  ulp_at_max = 2.0 ** (math.floor(math.log2(info.max)) - info.mantissa_bits)
  # Halfway to the next exponent step above max. IEEE formats round a tie to
  # even, and max's last mantissa bit is odd, so the tie goes to inf. The fp8
  # "fn" formats have no such next value: a tie rounds down to max.
  inclusive = not info.name.endswith("fn")
  return info.min_subnormal / 2, info.max + ulp_at_max / 2, inclusive


def _leaf_counts(
  g: jax.Array, scale: jax.Array, info: _dtypes.FormatInfo, exponent_range: tuple[int, int] | None
) -> _Counts:
  x = jnp.abs(jnp.asarray(g).astype(jnp.float32))
  finite = jnp.isfinite(x)
  nonzero = finite & (x > 0)
  y = x * scale  # the magnitude the format must hold
  tiny, huge, inclusive = _thresholds(info)
  overflows = (y >= huge) if inclusive else (y > huge)
  count = lambda mask: jnp.sum(mask, dtype=jnp.int32)
  if exponent_range is None:
    histogram = jnp.zeros((0,), jnp.int32)
  else:
    lo, hi = exponent_range
    # The biased exponent field is floor(log2 x) + 127 for normal float32
    # values; subnormals (field 0) lie below 2**-126 <= 2**lo, in bin 0 anyway.
    e = (lax.bitcast_convert_type(x, jnp.int32) >> 23) - 127
    n_bins = hi - lo + 2
    # Bin e - lo + 1, open-ended at both ends; zeros and non-finite values go
    # to an extra bin that is dropped (a constant update is the cheapest scatter).
    bins = jnp.where(nonzero, jnp.clip(e - lo + 1, 0, n_bins - 1), n_bins)
    histogram = (
      jnp.zeros((n_bins + 1,), jnp.int32).at[bins.ravel()].add(1, mode="promise_in_bounds")
    )[:n_bins]
  return _Counts(
    size=jnp.asarray(x.size, jnp.int32),
    zeros=count(x == 0),
    nonfinite=count(~finite),
    underflow=count(nonzero & (y <= tiny)),
    subnormal=count(nonzero & (y > tiny) & (y < info.min_normal)),
    overflow=count(finite & overflows),
    max_abs=jnp.max(jnp.where(finite, x, 0.0), initial=0.0),
    histogram=histogram,
  )


def _group_fn(group_by: Any) -> Callable[[str], str]:
  if callable(group_by):
    return group_by
  if group_by == "leaf":
    return lambda name: name
  if group_by == "layer":
    return lambda name: name.rsplit("/", 1)[0] if "/" in name else name
  if isinstance(group_by, int) and not isinstance(group_by, bool) and group_by >= 1:
    return lambda name: "/".join(name.split("/")[:group_by])
  raise ValueError(
    f"group_by must be 'layer', 'leaf', a positive int (path depth) or a callable, got "
    f"{group_by!r}."
  )


def _check_exponent_range(exponent_range: Any) -> tuple[int, int] | None:
  if exponent_range is None:
    return None
  try:
    lo, hi = exponent_range
  except (TypeError, ValueError):
    raise TypeError(
      f"exponent_range must be a pair of ints (lo, hi) or None, got {exponent_range!r}."
    ) from None
  if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (lo, hi)):
    raise TypeError(f"exponent_range must be a pair of ints, got {exponent_range!r}.")
  if not -126 <= lo < hi <= 128:
    raise ValueError(
      f"exponent_range must satisfy -126 <= lo < hi <= 128 (float32's normal exponents), got "
      f"{exponent_range}."
    )
  return int(lo), int(hi)


def gradient_statistics(
  grads: Any,
  *,
  loss_scale: Any = 1.0,
  format: _dtypes.DTypeLike = "float16",
  group_by: str | int | Callable[[str], str] = "layer",
  exponent_range: tuple[int, int] | None = DEFAULT_EXPONENT_RANGE,
  axis_name: Any = None,
) -> dict[str, GradientStats]:
  r"""Per-layer statistics of ``grads`` as ``format`` would store them at ``loss_scale``.

  Pass either the *true* gradients and the loss scale you train with, or the
  *scaled* gradients (what :func:`jmp_lite.scaled_value_and_grad` returns)
  with ``loss_scale=1``: the fractions are the same, the histogram shows the
  values you passed. Zeros show gradients that *already* underflowed (e.g.
  computed in float16 without enough scale); ``underflow_fraction`` shows
  those that *would* underflow in ``format``.

  Inside ``jit`` this costs a few elementwise passes and one scatter-add per
  leaf (``docs/troubleshooting.md`` has measured figures); wrap it in
  :func:`every_n_steps` to pay it every N steps only.

  Args:
    grads: a pytree of gradients; non-floating leaves (integers, ``float0``)
      and ``None`` are ignored.
    loss_scale: the scale :math:`S` applied before storing in ``format``: a
      positive number, a scalar array, or a jmp_lite loss scale whose
      ``gradient_scale`` is not None (e.g. ``jl.get_loss_scale(opt_state)``).
      Default 1.
    format: the target format (name or dtype), e.g. ``"float16"`` (default),
      ``"bfloat16"``, ``"float8_e5m2"``.
    group_by: ``"layer"`` (default: drop the last path component, so a Flax
      ``Dense``'s kernel and bias form ``"params/Dense_0"``), ``"leaf"``, an
      int (keep that many path components), or a function of the leaf's
      ``"a/b/c"`` path name returning its group name.
    exponent_range: ``(lo, hi)`` with ``-126 <= lo < hi <= 128``: histogram
      bins for exponents ``lo`` to ``hi - 1`` plus two open-ended bins
      (default ``(-64, 16)``); ``None`` skips the histogram.
    axis_name: under ``shard_map``/``pmap``, the axis whose shards hold parts
      of the same gradients: counts are summed and maxima taken over it.

  Returns:
    A dict from group name to :class:`GradientStats`, in the order the groups
    first appear in ``grads``: a pytree of arrays to return from a jitted step
    as metrics (see :func:`stats_to_metrics`).

  Raises:
    TypeError: for a ``loss_scale`` that is not a number, scalar array or
      loss scale with one gradient scale, a non-floating ``format``, or a ``group_by``
      function that does not return a string.
    ValueError: for a ``loss_scale`` that is not a positive finite scalar, an
      unknown ``format`` or ``group_by``, or an ``exponent_range`` outside
      float32's normal exponents.
  """
  info = _dtypes.format_info(format)
  scale = gradient_scale_value(
    loss_scale, instead="Pass the scaled gradients (what fp16 stores) and loss_scale=1."
  )
  exponent_range = _check_exponent_range(exponent_range)
  group = _group_fn(group_by)
  groups: dict[str, list[_Counts]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if leaf is None or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      continue
    name = group(_jaxpr.path_name(path))
    if not isinstance(name, str):
      raise TypeError(f"group_by must return a string, got {name!r} for {path!r}.")
    groups.setdefault(name, []).append(_leaf_counts(leaf, scale, info, exponent_range))
  out = {}
  for name, parts in groups.items():
    total = jax.tree.map(lambda *xs: functools.reduce(jnp.add, xs), *parts)
    max_abs = functools.reduce(jnp.maximum, [p.max_abs for p in parts])
    if axis_name is not None:
      total = jax.tree.map(lambda x: lax.psum(x, axis_name), total)
      max_abs = lax.pmax(max_abs, axis_name)
    size = jnp.maximum(total.size, 1).astype(jnp.float32)
    frac = lambda n, size=size: n.astype(jnp.float32) / size
    out[name] = GradientStats(
      size=total.size,
      zero_fraction=frac(total.zeros),
      nonfinite_fraction=frac(total.nonfinite),
      underflow_fraction=frac(total.underflow),
      subnormal_fraction=frac(total.subnormal),
      overflow_fraction=frac(total.overflow),
      max_abs=max_abs,
      histogram=total.histogram,
      min_exponent=jnp.asarray(exponent_range[0] if exponent_range else 0, jnp.int32),
      loss_scale=scale,
    )
  return out
