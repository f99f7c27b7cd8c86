"""Gradient statistics and loss-scale health, computed inside the train step.

Three tools, all jit-compatible with no host sync in the hot path:

* :func:`gradient_statistics`: per leaf or per layer, a histogram of
  :math:`\\lfloor\\log_2|g|\\rfloor`, the fraction of zeros, of non-finite
  values, and of values that would underflow (round to 0), land in the
  subnormal range, or overflow once multiplied by a loss scale and stored in
  a target format. Cheap enough to return as metrics every N steps
  (:func:`every_n_steps`).
* :class:`LossScaleMonitor` and :func:`loss_scale_health`: collapse detection
  from the counters of :func:`jmp_lite.loss_scaling`'s state: the scale at its
  minimum for K consecutive steps, or a skipped-step rate above a threshold.
* :func:`likely_culprits` (on the host, on fetched statistics): names the
  layers where non-finite gradients start, or that overflow or underflow.

A train step that logs all three::

  monitor = jl.LossScaleMonitor.create(window=100)

  @jax.jit
  def train_step(params, opt_state, monitor, batch, step):
    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, batch)
    # Statistics of the scaled gradients, as float16 must hold them.
    stats = jl.every_n_steps(step, 100, jl.gradient_statistics, grads, format="float16")
    updates, opt_state = tx.update(grads, opt_state, params)
    monitor = monitor.update(opt_state)
    health = jl.loss_scale_health(opt_state, monitor)
    return optax.apply_updates(params, updates), opt_state, monitor, (loss, stats, health)

  # on the host, when health.unhealthy:
  print(health.describe())
  print(jl.likely_culprits(stats, order=jl.parameter_order(loss_fn, params, batch)))
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _jaxpr
from jmp_lite import _loss_scale as loss_scale_lib
from jmp_lite import _transform as transform

__all__ = [
  "Culprit",
  "GradientStats",
  "LossScaleHealth",
  "LossScaleMonitor",
  "every_n_steps",
  "gradient_statistics",
  "likely_culprits",
  "loss_scale_health",
  "parameter_order",
  "stats_to_metrics",
]

DEFAULT_EXPONENT_RANGE = (-64, 16)

# --------------------------------------------------------------------------------------------
# Gradient statistics


class GradientStats(NamedTuple):
  """Statistics of the gradients of one leaf or layer (a pytree of arrays).

  Fractions are of all ``size`` values. For a gradient :math:`g`, a loss scale
  :math:`S` and a target format with smallest subnormal :math:`s_{min}`,
  smallest normal :math:`n_{min}` and largest value :math:`M`:

  * ``underflow_fraction``: :math:`g \\ne 0` and :math:`|gS| \\le s_{min}/2`
    (rounds to 0 in the format);
  * ``subnormal_fraction``: :math:`s_{min}/2 < |gS| < n_{min}` (kept with
    fewer significant bits; flushed to 0 on hardware without subnormals);
  * ``overflow_fraction``: :math:`|gS|` rounds beyond :math:`M` (inf, or NaN
    for the ``fn`` fp8 formats); values already non-finite are counted in
    ``nonfinite_fraction`` instead.

  ``histogram`` counts the finite non-zero values by binary exponent
  :math:`e = \\lfloor\\log_2|g|\\rfloor` of the *unscaled* input: bin 0 holds
  :math:`e < \\mathrm{min\\_exponent}`, bin :math:`i` holds
  :math:`e = \\mathrm{min\\_exponent} + i - 1`, the last bin everything from
  the top of the range up. It is empty when statistics were computed with
  ``exponent_range=None``.
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
    """Exponent of each histogram bin (host-side); the first and last bins
    are open-ended and labelled with the exponent just outside the range."""
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


def _thresholds(info: dtypes.FormatInfo) -> tuple[float, float, bool]:
  """(largest |x| that rounds to 0, smallest |x| that overflows, whether that
  overflow bound is inclusive)."""
  ulp_at_max = 2.0 ** (math.floor(math.log2(info.max)) - info.mantissa_bits)
  # Halfway to the next exponent step above max. IEEE formats round a tie to
  # even, and max's last mantissa bit is odd, so the tie goes to inf. The fp8
  # "fn" formats have no such next value: a tie rounds down to max.
  inclusive = not info.name.endswith("fn")
  return info.min_subnormal / 2, info.max + ulp_at_max / 2, inclusive


def _leaf_counts(
  g: jax.Array, scale: jax.Array, info: dtypes.FormatInfo, exponent_range: tuple[int, int] | None
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


def _scale_value(loss_scale: Any) -> jax.Array:
  if isinstance(loss_scale, loss_scale_lib.LossScale):
    if not loss_scale.uniform:
      raise TypeError(
        f"loss_scale: a {type(loss_scale).__name__} gives each stage its own scale; pass the "
        "scaled gradients (what fp16 stores) and loss_scale=1."
      )
    loss_scale = loss_scale.loss_scale
  if isinstance(loss_scale, (bool, np.bool_)) or not isinstance(
    loss_scale, (numbers.Real, np.ndarray, np.generic, jax.Array)
  ):
    raise TypeError(
      "loss_scale must be a positive number, a scalar array or a jmp_lite.LossScale, "
      f"got {type(loss_scale).__name__}."
    )
  scale = jnp.asarray(loss_scale, jnp.float32)
  if scale.shape != ():
    raise ValueError(f"loss_scale must be a scalar, got shape {scale.shape}.")
  if not isinstance(scale, jax.core.Tracer) and not (float(scale) > 0 and np.isfinite(scale)):
    raise ValueError(f"loss_scale must be positive and finite, got {float(scale)}.")
  return scale


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
  format: dtypes.DTypeLike = "float16",
  group_by: str | int | Callable[[str], str] = "layer",
  exponent_range: tuple[int, int] | None = DEFAULT_EXPONENT_RANGE,
  axis_name: Any = None,
) -> dict[str, GradientStats]:
  """Per-layer statistics of ``grads`` as ``format`` would store them at ``loss_scale``.

  Pass either the *true* gradients and the loss scale you train with, or the
  *scaled* gradients (what :func:`jmp_lite.scaled_value_and_grad` returns)
  with ``loss_scale=1``: the fractions are the same, the histogram shows the
  values you passed. Zeros show gradients that *already* underflowed (e.g.
  computed in float16 without enough scale); ``underflow_fraction`` shows
  those that *would* underflow in ``format``.

  Inside ``jit`` this costs a few elementwise passes and one scatter-add per
  leaf (see ``docs/troubleshooting.md`` for measured figures); wrap it in
  :func:`every_n_steps` to pay it every N steps only.

  Args:
    grads: a pytree of gradients; non-floating leaves (integers, ``float0``)
      and ``None`` are ignored.
    loss_scale: the scale :math:`S` applied before storing in ``format``: a
      number, a scalar array, or a jmp_lite loss scale (e.g.
      ``jl.get_loss_scale(opt_state)``).
    format: the target format (name or dtype), e.g. ``"float16"``,
      ``"bfloat16"``, ``"float8_e5m2"``.
    group_by: ``"layer"`` (default: drop the last path component, so a Flax
      ``Dense``'s kernel and bias form ``"params/Dense_0"``), ``"leaf"``, an
      int (keep that many path components), or a function of the leaf's
      ``"a/b/c"`` path name returning its group name.
    exponent_range: ``(lo, hi)``: histogram bins for exponents ``lo`` to
      ``hi - 1`` plus two open-ended bins; ``None`` skips the histogram.
    axis_name: under ``shard_map``/``pmap``, the axis whose shards hold parts
      of the same gradients: counts are summed and maxima taken over it.

  Returns:
    A dict from group name to :class:`GradientStats`: a pytree of arrays to
    return from a jitted step as metrics (see :func:`stats_to_metrics`).
  """
  info = dtypes.format_info(format)
  scale = _scale_value(loss_scale)
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


_METRIC_FIELDS = (
  "zero_fraction",
  "nonfinite_fraction",
  "underflow_fraction",
  "subnormal_fraction",
  "overflow_fraction",
  "max_abs",
)


def stats_to_metrics(stats: Mapping[str, GradientStats], prefix: str = "grads") -> dict[str, Any]:
  """Flattens statistics to scalar metrics ``{"grads/<layer>/<field>": value}``
  for a logger (histograms are left out; log them separately if wanted)."""
  return {
    f"{prefix}/{name}/{field}": getattr(s, field)
    for name, s in stats.items()
    for field in _METRIC_FIELDS
  }


def every_n_steps(step: Any, n: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """``fn(*args, **kwargs)`` on steps divisible by ``n``, zeros of the same
  structure otherwise, via :func:`jax.lax.cond` (only one branch runs).

  Under ``vmap`` a ``cond`` on a batched predicate runs both branches; call
  it outside ``vmap``.

  Args:
    step: the step number, an integer scalar (traced or not).
    n: the period, a Python int >= 1.
    fn: the function to run, e.g. :func:`gradient_statistics`.
  """
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n must be a Python int >= 1, got {n!r}.")
  step = jnp.asarray(step)
  if not jnp.issubdtype(step.dtype, jnp.integer) or step.shape != ():
    raise TypeError(f"step must be an integer scalar, got {step.dtype}{list(step.shape)}.")
  call = lambda a: fn(*a, **kwargs)
  shapes = jax.eval_shape(call, args)
  zeros = lambda a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return lax.cond(step % n == 0, call, zeros, args)


# --------------------------------------------------------------------------------------------
# Forward order of parameters


def parameter_order(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> tuple:
  """Leaf names of ``params`` (``"params/Dense_0/kernel"``...) in the order
  ``fn(params, *args, **kwargs)`` first computes with them: the forward order
  of the layers, which :func:`likely_culprits` needs.

  ``fn`` is traced, not run. Casts, reshapes and broadcasts are not uses (a
  policy casting every parameter up front does not decide the order); the
  first real operation is. Parameters never used come last, in tree order.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  names = [_jaxpr.path_name(p) for p, _ in leaves]
  closed = jax.make_jaxpr(lambda p: fn(p, *args, **kwargs))(params)
  first: dict[str, int] = {}
  counter = itertools.count()

  def walk(jaxpr, owners: dict[Any, frozenset[str]]):
    for eqn in jaxpr.eqns:
      position = next(counter)
      used = frozenset().union(
        *(owners.get(v, frozenset()) for v in eqn.invars if not _jaxpr.is_literal(v))
      )
      if not used:
        continue
      if eqn.primitive.name in _jaxpr.TRANSPARENT:
        for v in eqn.outvars:
          owners[v] = used
        continue
      subs = _jaxpr.sub_jaxprs(eqn)
      bound = set()
      for sub in subs:
        inner = {}
        for var, atom in zip(sub.jaxpr.invars, sub.bindings, strict=True):
          if atom is not None and not _jaxpr.is_literal(atom) and atom in owners:
            inner[var] = owners[atom]
            bound.add(atom)
        walk(sub.jaxpr, inner)
      for v in eqn.invars:  # operands used directly here
        if not _jaxpr.is_literal(v) and v in owners and v not in bound:
          for name in owners[v]:
            first.setdefault(name, position)

  walk(closed.jaxpr, {v: frozenset([n]) for v, n in zip(closed.jaxpr.invars, names, strict=True)})
  ranked = sorted(enumerate(names), key=lambda item: (first.get(item[1], math.inf), item[0]))
  return tuple(name for _, name in ranked)


# --------------------------------------------------------------------------------------------
# Culprits


class Culprit(NamedTuple):
  """A layer named by :func:`likely_culprits`."""

  name: str
  problem: str  # "non-finite", "overflow" or "underflow"
  fraction: float
  explanation: str

  def __str__(self) -> str:
    return f"{self.name}: {self.explanation}"


def _natural_key(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def likely_culprits(
  stats: Mapping[str, GradientStats],
  *,
  order: Sequence[str] | None = None,
  underflow_threshold: float = 0.01,
  max_results: int = 3,
) -> tuple[Culprit, ...]:
  """Names the layers most likely behind a collapse, from fetched statistics.

  Host-side (it reads values): call it on the statistics a jitted step
  returned. In order of priority:

  1. **Non-finite gradients.** Backpropagation runs from the output to the
     input, and a NaN or inf spreads from where it appears to every earlier
     layer. The culprit is therefore the non-finite layer *closest to the
     output*, i.e. the last one in forward ``order`` (each such boundary is
     reported if there are several).
  2. **Overflow**: layers whose scaled gradients exceed the format's range,
     by overflowing fraction.
  3. **Underflow**: layers where more than ``underflow_threshold`` of the
     values round to 0 at this scale, by fraction.

  Args:
    stats: the output of :func:`gradient_statistics` (fetched or not).
    order: layer or leaf names in forward order, e.g. from
      :func:`parameter_order`; a group's position is that of its first leaf.
      Default: natural sort of the names (``Dense_2`` before ``Dense_10``),
      which matches Flax's auto-names but not necessarily your model.
    underflow_threshold: fraction of underflowing values that counts.
    max_results: at most this many culprits are returned.
  """
  if not isinstance(stats, Mapping):
    raise TypeError(f"stats must be the dict gradient_statistics returns, got {type(stats)}.")
  if isinstance(order, str):
    raise TypeError("order must be a sequence of names, not a string.")
  stats = jax.device_get(dict(stats))
  names = list(stats)

  def rank(name: str) -> tuple:
    if order is not None:
      for i, entry in enumerate(order):
        if entry == name or entry.startswith(name + "/"):
          return (0, i)
    return (1, _natural_key(name))

  forward = sorted(names, key=rank)
  value = lambda name, field: float(np.asarray(getattr(stats[name], field)))
  culprits = []
  for i, name in enumerate(forward):
    frac = value(name, "nonfinite_fraction")
    later_finite = i + 1 == len(forward) or value(forward[i + 1], "nonfinite_fraction") == 0
    if frac > 0 and later_finite:
      before = sum(value(n, "nonfinite_fraction") > 0 for n in forward[:i])
      after = "it is the last layer" if i + 1 == len(forward) else "the layers after it are finite"
      culprits.append(
        Culprit(
          name,
          "non-finite",
          frac,
          f"{frac:.1%} of its gradients are NaN/inf and {after}: non-finite values enter the "
          f"backward pass here ({before} earlier layer{'s' * (before != 1)} inherit them).",
        )
      )
  culprits.reverse()  # closest to the output first
  overflow = sorted(
    (n for n in names if value(n, "overflow_fraction") > 0),
    key=lambda n: -value(n, "overflow_fraction"),
  )
  for name in overflow:
    frac, biggest = value(name, "overflow_fraction"), value(name, "max_abs")
    scale = value(name, "loss_scale")
    culprits.append(
      Culprit(
        name,
        "overflow",
        frac,
        f"{frac:.2%} of its gradients overflow the format at loss scale {scale:g} (largest "
        f"|g| = {biggest:.3g}).",
      )
    )
  underflow = sorted(
    (n for n in names if value(n, "underflow_fraction") > underflow_threshold),
    key=lambda n: -value(n, "underflow_fraction"),
  )
  for name in underflow:
    frac = value(name, "underflow_fraction")
    culprits.append(
      Culprit(
        name,
        "underflow",
        frac,
        f"{frac:.1%} of its gradients round to 0 in the format at loss scale "
        f"{value(name, 'loss_scale'):g}: they are lost.",
      )
    )
  return tuple(culprits[:max_results])


# --------------------------------------------------------------------------------------------
# Loss-scale health


def _at_minimum(scale: loss_scale_lib.LossScale) -> jax.Array:
  return jnp.asarray(scale.at_minimum)


class LossScaleMonitor(NamedTuple):
  """Tracks what :class:`jmp_lite.transform.LossScalingState` does not: how
  long the scale has been at its minimum, and which recent steps were skipped.

  A pytree of three arrays; create it once, update it after each
  ``tx.update`` inside the jitted step and carry it like the optimizer state::

    monitor = jl.LossScaleMonitor.create(window=100)
    ...
    updates, opt_state = tx.update(grads, opt_state, params)
    monitor = monitor.update(opt_state)
  """

  steps_at_minimum: jax.Array  # consecutive updates that left the scale at its minimum
  recent_skips: jax.Array  # bool[window], a ring buffer of skipped-step flags
  updates: jax.Array  # updates observed

  @classmethod
  def create(cls, window: int = 100) -> LossScaleMonitor:
    """A fresh monitor whose skip rate covers the last ``window`` steps."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
      raise ValueError(f"window must be an int >= 1, got {window!r}.")
    return cls(
      steps_at_minimum=jnp.zeros((), jnp.int32),
      recent_skips=jnp.zeros((int(window),), jnp.bool_),
      updates=jnp.zeros((), jnp.int32),
    )

  @property
  def window(self) -> int:
    return int(np.shape(self.recent_skips)[0])

  def update(self, opt_state: Any) -> LossScaleMonitor:
    """Records the step that produced ``opt_state`` (call once per update)."""
    state = transform.get_loss_scaling_state(opt_state)
    at_min = _at_minimum(state.loss_scale)
    slot = self.updates % self.window
    return LossScaleMonitor(
      steps_at_minimum=jnp.where(at_min, self.steps_at_minimum + 1, 0).astype(jnp.int32),
      recent_skips=self.recent_skips.at[slot].set(~state.last_finite),
      updates=self.updates + 1,
    )


class LossScaleHealth(NamedTuple):
  """Whether loss scaling works (a pytree of arrays, jit-compatible).

  Attributes:
    loss_scale: the current scale.
    at_minimum: the scale equals its ``min_loss_scale`` (dynamic scales; for
      a ``LayerwiseLossScale``, any stage's scale).
    steps_at_minimum: consecutive steps at the minimum. With a monitor,
      exact; without, the consecutive skipped steps while at the minimum (a
      lower bound).
    consecutive_skips, steps, skipped_steps: from the loss-scaling state.
    skip_rate: skipped fraction of the monitor's window (of all steps
      without a monitor).
    collapsed: ``steps_at_minimum >= max_steps_at_minimum``.
    skip_rate_too_high: ``skip_rate > max_skip_rate`` once enough steps
      were observed.
    unhealthy: either of the two.
  """

  loss_scale: jax.Array
  at_minimum: jax.Array
  steps_at_minimum: jax.Array
  consecutive_skips: jax.Array
  steps: jax.Array
  skipped_steps: jax.Array
  skip_rate: jax.Array
  collapsed: jax.Array
  skip_rate_too_high: jax.Array
  unhealthy: jax.Array

  def describe(self) -> str:
    """A human-readable verdict with what to do (host-side: reads the values)."""
    h = jax.device_get(self)
    scale, steps = float(h.loss_scale), int(h.steps)
    lines = [
      f"loss scale {scale:g} after {steps} steps; {int(h.skipped_steps)} skipped "
      f"({int(h.consecutive_skips)} in a row now); recent skip rate {float(h.skip_rate):.1%}."
    ]
    if bool(h.collapsed):
      lines.append(
        f"COLLAPSED: the scale has been at its minimum for {int(h.steps_at_minimum)} "
        "consecutive steps and gradients are still non-finite. Lowering the scale does not "
        "help: something produces inf/NaN independent of the scale (an op overflowing in "
        "16 bits, a log of 0, a NaN in the data). Find the layer with "
        "jl.likely_culprits(stats) and the op with jl.audit(...)."
      )
    if bool(h.skip_rate_too_high):
      lines.append(
        f"TOO MANY SKIPS: {float(h.skip_rate):.0%} of recent steps were skipped, so the "
        "model barely trains. If the scale oscillates, raise hysteresis or lower the growth "
        "(larger period); if it sits low, see jl.likely_culprits(stats)."
      )
    if not bool(h.unhealthy):
      lines.append("healthy.")
    return "\n".join(lines)


def loss_scale_health(
  opt_state: Any,
  monitor: LossScaleMonitor | None = None,
  *,
  max_steps_at_minimum: int = 10,
  max_skip_rate: float = 0.2,
  min_steps: int | None = None,
) -> LossScaleHealth:
  """Collapse detection from :func:`jmp_lite.loss_scaling`'s counters (jit-compatible).

  Args:
    opt_state: the optimizer state, or any state containing one
      :class:`~jmp_lite.transform.LossScalingState`.
    monitor: a :class:`LossScaleMonitor` updated with this state, for the exact
      time at the minimum and a windowed skip rate.
    max_steps_at_minimum: K: collapsed once the scale has been at its minimum
      for K consecutive steps.
    max_skip_rate: flagged when the skip rate exceeds this.
    min_steps: steps that must be observed before the skip rate is judged
      (default: the monitor's window, or 100 without a monitor), so the
      initial back-off from a high starting scale is not an alarm.
  """
  if isinstance(max_steps_at_minimum, bool) or not isinstance(
    max_steps_at_minimum, numbers.Integral
  ):
    raise TypeError(f"max_steps_at_minimum must be an int, got {max_steps_at_minimum!r}.")
  if max_steps_at_minimum < 1:
    raise ValueError(f"max_steps_at_minimum must be >= 1, got {max_steps_at_minimum}.")
  if not isinstance(max_skip_rate, numbers.Real) or not 0 <= max_skip_rate <= 1:
    raise ValueError(f"max_skip_rate must be a number in [0, 1], got {max_skip_rate!r}.")
  if monitor is not None and not isinstance(monitor, LossScaleMonitor):
    raise TypeError(f"monitor must be a LossScaleMonitor, got {type(monitor).__name__}.")
  state = transform.get_loss_scaling_state(opt_state)
  at_min = _at_minimum(state.loss_scale)
  if monitor is None:
    steps_at_min = jnp.where(at_min, state.consecutive_skips, 0)
    observed = state.steps
    skip_rate = state.skipped_steps / jnp.maximum(state.steps, 1)
    min_steps = 100 if min_steps is None else min_steps
  else:
    steps_at_min = monitor.steps_at_minimum
    observed = jnp.minimum(monitor.updates, monitor.window)
    skip_rate = jnp.sum(monitor.recent_skips, dtype=jnp.int32) / jnp.maximum(observed, 1)
    min_steps = monitor.window if min_steps is None else min_steps
  if isinstance(min_steps, bool) or not isinstance(min_steps, numbers.Integral) or min_steps < 1:
    raise ValueError(f"min_steps must be an int >= 1, got {min_steps!r}.")
  skip_rate = skip_rate.astype(jnp.float32)
  collapsed = steps_at_min >= max_steps_at_minimum
  too_many = (skip_rate > max_skip_rate) & (observed >= min_steps)
  return LossScaleHealth(
    loss_scale=jnp.asarray(state.loss_scale.loss_scale),
    at_minimum=at_min,
    steps_at_minimum=steps_at_min.astype(jnp.int32),
    consecutive_skips=state.consecutive_skips,
    steps=state.steps,
    skipped_steps=state.skipped_steps,
    skip_rate=skip_rate,
    collapsed=collapsed,
    skip_rate_too_high=too_many,
    unhealthy=collapsed | too_many,
  )
