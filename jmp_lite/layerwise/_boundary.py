r"""The stage boundary: the identity forward, a change of scale backward.

Between stage :math:`k` and stage :math:`k+1` of a chain
:math:`f = f_{K-1} \circ \dots \circ f_0` sits a boundary. Forward it returns
its input unchanged; backward it multiplies the cotangent by
:math:`S_k / S_{k+1}`, so stage :math:`k`'s backward pass runs at its own scale
:math:`S_k`. Both scales are powers of two, so the conversion is exact.

It also reports statistics of the cotangent it sees (the max and a histogram
of :math:`\lfloor \log_2 |g| \rfloor`) as the gradient of a zero *probe*
input, so that ``jax.grad`` returns them with the parameter gradients: no host
sync. The boundaries are inactive (identities) unless a
:class:`BoundaryContext` is in scope, which :func:`with_boundaries` sets while
the loss is differentiated. The context is ambient (``_ACTIVE``) because
:func:`stage_boundary` is called inside the user's model, by the loss function
the differentiation receives as a closure (or by a Flax layer), and so cannot
be given it as an argument.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite._context import Ambient

HIST_MIN_EXP = -64
"""Exponent of the first histogram bin; smaller magnitudes are counted there."""
HIST_BINS = 128
"""Histogram bins: ``floor(log2|g|)`` from HIST_MIN_EXP to HIST_MIN_EXP + 127."""


class BoundaryStats(NamedTuple):
  """Statistics of the cotangents at the stage boundaries.

  Attributes:
    amax: ``f32[num_stages - 1]``, the largest ``|g|`` seen at each boundary,
      in the units of the stage above it (scale ``S_{k+1}``).
    histogram: ``f32[num_stages - 1, HIST_BINS]``, counts of the nonzero finite
      ``|g|`` by ``floor(log2|g|)``, same units.
  """

  amax: jax.Array
  histogram: jax.Array


def zero_probes(num_boundaries: int) -> BoundaryStats:
  """The probes: zeros whose gradients are the boundaries' statistics."""
  return BoundaryStats(
    jnp.zeros((num_boundaries,), jnp.float32),
    jnp.zeros((num_boundaries, HIST_BINS), jnp.float32),
  )


def log2_histogram(x: jax.Array) -> jax.Array:
  """Counts of the nonzero finite ``|x|`` by ``floor(log2|x|)`` (``f32[HIST_BINS]``).

  Magnitudes outside the bins' range are counted in the first or last bin.
  """
  a = jnp.abs(x.astype(jnp.float32)).ravel()
  counted = (a > 0) & jnp.isfinite(a)
  exponent = jnp.frexp(a)[1] - 1  # floor(log2 a) for a > 0
  bins = jnp.clip(exponent - HIST_MIN_EXP, 0, HIST_BINS - 1)
  return jnp.zeros(HIST_BINS, jnp.float32).at[bins].add(counted.astype(jnp.float32))


def abs_max(x: jax.Array) -> jax.Array:
  """``max |x|`` in float32, inf if ``x`` has a NaN: the statistic and the finiteness at once.

  (``jnp.max`` alone may drop NaN: XLA:CPU's max does.)
  """
  a = jnp.abs(x.astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), initial=0.0)


class StatsMode(NamedTuple):
  """Which statistics the boundaries take (static: part of the traced program)."""

  histograms: bool  # log2 histograms on refresh steps
  max_every_step: bool  # the max on every step, not under a conditional


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _boundary(mode, x, ratio, compute_stats, probe_amax, probe_histogram):
  del mode, ratio, compute_stats, probe_amax, probe_histogram
  return x


def _boundary_fwd(mode, x, ratio, compute_stats, probe_amax, probe_histogram):
  del mode, probe_amax, probe_histogram
  return x, (ratio, compute_stats)


def _boundary_bwd(mode, residuals, ct):
  ratio, compute_stats = residuals
  no_histogram = jnp.zeros(HIST_BINS, jnp.float32)
  histogram = (lambda: log2_histogram(ct)) if mode.histograms else (lambda: no_histogram)
  # The max is one more read of an activation-sized cotangent: on a refresh
  # step only, unless every step is one (then a conditional would only get in
  # the way of XLA's fusion). The histogram is a scatter per value.
  if mode.max_every_step:
    amax = abs_max(ct)
    if mode.histograms:
      histogram = lax.cond(compute_stats > 0, histogram, lambda: no_histogram)
    else:
      histogram = no_histogram
  else:
    amax, histogram = lax.cond(
      compute_stats > 0,
      lambda: (abs_max(ct), histogram()),
      lambda: (jnp.float32(0), no_histogram),
    )
  # In fp32: the ratio may be outside the cotangent dtype's range; a power of
  # two times a value is exact unless the result leaves the range.
  converted = (ct.astype(jnp.float32) * ratio).astype(ct.dtype)
  return converted, jnp.zeros_like(ratio), jnp.zeros_like(compute_stats), amax, histogram


_boundary.defvjp(_boundary_fwd, _boundary_bwd)


@dataclasses.dataclass(frozen=True)
class BoundaryContext:
  """What the active boundaries of one differentiation use.

  Attributes:
    mode: which statistics to take.
    ratios: ``f32[num_stages - 1]``, ``S_k / S_{k+1}`` for each boundary.
    compute_stats: a float32 scalar, > 0 on a refresh step.
    probes: the zero inputs whose gradients are the statistics.
  """

  mode: StatsMode
  ratios: jax.Array
  compute_stats: jax.Array
  probes: BoundaryStats


_ACTIVE: Ambient[BoundaryContext] = Ambient("jmp_lite.layerwise.boundaries")


def with_boundaries(
  fun: Callable[..., Any], mode: StatsMode, ratios: Any, compute_stats: Any
) -> Callable[..., Any]:
  """``fun`` with the boundaries active; it takes the probes as an extra last argument.

  Args:
    fun: the function whose stage boundaries convert scales and take statistics.
    mode: which statistics to take.
    ratios: ``S_k / S_{k+1}`` for each boundary.
    compute_stats: > 0 on a refresh step.

  Returns:
    ``g(*args, probes, **kwargs)`` returning ``fun(*args, **kwargs)``:
    differentiated with respect to ``probes`` (a :class:`BoundaryStats` such as
    :func:`zero_probes` gives), it returns the boundaries' statistics.
  """

  def fun_with_probes(*args: Any, **kwargs: Any) -> Any:
    *inputs, probes = args
    with _ACTIVE.scope(BoundaryContext(mode, ratios, compute_stats, probes)):
      return fun(*inputs, **kwargs)

  return fun_with_probes


def stage_boundary(x: jax.Array, index: int | jax.Array) -> jax.Array:
  """Marks the boundary between stage ``index`` and stage ``index + 1``.

  The identity, except while :func:`jmp_lite.scaled_value_and_grad` computes
  layer-wise scaled gradients: then the backward pass converts the cotangent
  from stage ``index + 1``'s scale to stage ``index``'s and records its
  statistics. Each boundary index should be used once per step.

  Args:
    x: the activations that flow from stage ``index`` to stage ``index + 1``
      (a floating-point array).
    index: the boundary's index, in ``[0, num_stages - 1)``; it may be traced
      (e.g. the iteration of a ``scan`` over a stack of layers).

  Returns:
    ``x`` itself.
  """
  context = _ACTIVE.current()
  if context is None:
    return x
  if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"stage_boundary expects a floating-point array, got {type(x).__name__}.")
  num_boundaries = context.ratios.shape[0]
  if isinstance(index, int) and not 0 <= index < num_boundaries:
    raise ValueError(
      f"Boundary index {index} is out of range: with {num_boundaries + 1} stages the "
      f"boundaries are 0..{num_boundaries - 1}."
    )
  return _boundary(
    context.mode,
    x,
    context.ratios[index],
    context.compute_stats,
    context.probes.amax[index],
    context.probes.histogram[index],
  )
