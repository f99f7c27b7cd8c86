"""Matplotlib figures of the diagnostics (implementation of :mod:`jmp_lite.plotting`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from jmp_lite import _dtypes, _validation
from jmp_lite.diagnostics import GradientStats

# Statistics are recognized by these fields (what the plots read), not by type.
_STATS_FIELDS = ("histogram", "min_exponent", "loss_scale", "underflow_fraction", "zero_fraction")


def _is_stats(x: Any) -> TypeGuard[GradientStats]:
  return all(hasattr(x, f) for f in _STATS_FIELDS)


def _pyplot():
  try:
    # Optional dependency: imported when the first plot is drawn, not with this module.
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError(
      "jmp_lite.plotting needs matplotlib: pip install matplotlib (in a clone of jmp_lite, "
      "pip install -e '.[examples]' installs it with the examples' other extras)."
    ) from e
  return plt


def _axes(ax: Any) -> Any:
  if ax is not None:
    return ax
  _, ax = _pyplot().subplots()
  return ax


def _as_stats_list(stats: GradientStats | Mapping[str, GradientStats]) -> list[GradientStats]:
  if _is_stats(stats):
    return [stats]
  if isinstance(stats, Mapping) and stats and all(_is_stats(s) for s in stats.values()):
    return list(stats.values())
  raise TypeError(
    "stats must be a GradientStats or a non-empty dict of them (from gradient_statistics), got "
    f"{type(stats).__name__}."
  )


def plot_gradient_histogram(
  stats: GradientStats | Mapping[str, GradientStats],
  format: _dtypes.DTypeLike = "float16",
  *,
  loss_scale: float | None = None,
  ax: Any = None,
  title: str | None = None,
) -> Any:
  r"""Histogram of gradient exponents against ``format``'s representable range.

  Bars count values by :math:`\lfloor\log_2|g|\rfloor` (summed over layers
  for a dict). Shaded: the magnitudes ``format`` holds at scale :math:`S`,
  :math:`[n_{min}/S, M/S]` (normal) and :math:`[s_{min}/S, n_{min}/S)`
  (subnormal); bars left of the shading underflow to 0, bars right of it
  overflow. A well-chosen scale puts all bars inside.

  Args:
    stats: a :class:`~jmp_lite.diagnostics.GradientStats` or the dict
      :func:`~jmp_lite.diagnostics.gradient_statistics` returns, fetched to
      the host, computed with one ``exponent_range`` (not ``None``).
    format: the format whose range is drawn (default ``"float16"``).
    loss_scale: :math:`S`; default: the scale the statistics were computed at.
    ax: matplotlib axes to draw on (default: a new figure's).
    title: the axes title (default: a description).

  Returns:
    The axes drawn on.

  Raises:
    TypeError: if ``stats`` is not statistics or a non-empty dict of them.
    ValueError: for statistics without a histogram, or over different
      exponent ranges, or a ``loss_scale`` that is not positive and finite.
  """
  parts = _as_stats_list(stats)
  lengths = {int(np.shape(p.histogram)[-1]) for p in parts}
  starts = {int(np.asarray(p.min_exponent)) for p in parts}
  if len(lengths) != 1 or len(starts) != 1 or lengths == {0}:
    raise ValueError(
      "The statistics have no histogram or histograms over different exponent ranges; compute "
      "them with one exponent_range (not None)."
    )
  counts = np.sum([np.asarray(p.histogram) for p in parts], axis=0)
  # Bin i holds exponent min_exponent + i - 1 (the first and last bins are open-ended).
  exponents = starts.pop() - 1 + np.arange(lengths.pop())
  scale = _validation.as_bound(
    parts[0].loss_scale if loss_scale is None else loss_scale, "loss_scale", np.dtype(np.float64)
  )
  info = _dtypes.format_info(format)
  shift = math.log2(scale)
  lo_sub = math.log2(info.min_subnormal) - shift
  lo_normal = math.log2(info.min_normal) - shift
  hi = math.log2(info.max) - shift

  ax = _axes(ax)
  ax.bar(exponents, counts, width=1.0, align="edge", color="tab:blue", label="gradients")
  ax.axvspan(lo_normal, hi, color="tab:green", alpha=0.15, label=f"{info.name} normal range")
  ax.axvspan(lo_sub, lo_normal, color="tab:orange", alpha=0.2, label=f"{info.name} subnormal")
  ax.axvline(lo_sub, color="tab:red", linestyle="--", linewidth=1, label="underflow below")
  ax.set_xlabel("floor(log2 |g|)  (first and last bars: open-ended)")
  ax.set_ylabel("count")
  ax.set_title(
    title if title is not None else f"gradient exponents vs {info.name} at S = {scale:g}"
  )
  ax.legend(loc="upper left", fontsize="small")
  return ax


_FIELDS = {
  "underflow_fraction": ("underflow", "tab:red"),
  "subnormal_fraction": ("subnormal", "tab:orange"),
  "zero_fraction": ("zero", "tab:gray"),
  "overflow_fraction": ("overflow", "tab:purple"),
  "nonfinite_fraction": ("NaN/inf", "black"),
}


def plot_underflow_by_layer(
  stats: Mapping[str, GradientStats],
  *,
  fields: Sequence[str] = ("underflow_fraction", "subnormal_fraction", "zero_fraction"),
  ax: Any = None,
  title: str = "gradient values lost per layer",
) -> Any:
  """Horizontal bars per layer: the fractions of gradient values lost or at risk.

  Layers are drawn top to bottom in the order of ``stats``; each field is a
  bar of its own colour.

  Args:
    stats: the dict :func:`~jmp_lite.diagnostics.gradient_statistics`
      returns, fetched to the host.
    fields: which fractions to show, among ``underflow_fraction``,
      ``subnormal_fraction``, ``zero_fraction``, ``overflow_fraction``,
      ``nonfinite_fraction`` (default: the first three).
    ax: matplotlib axes to draw on (default: a new figure's).
    title: the axes title.

  Returns:
    The axes drawn on.

  Raises:
    TypeError: if ``stats`` is not a non-empty dict of statistics.
    ValueError: for no field, or one not listed above.
  """
  if not isinstance(stats, Mapping):
    raise TypeError(f"stats must be a dict of GradientStats, got {type(stats).__name__}.")
  _as_stats_list(stats)
  unknown = [f for f in fields if f not in _FIELDS]
  if unknown or not fields:
    raise ValueError(f"Unknown or no fields {unknown or fields!r}; choose from {list(_FIELDS)}.")
  names = list(stats)
  ax = _axes(ax)
  height = 0.8 / len(fields)
  y = np.arange(len(names))
  for i, field in enumerate(fields):
    values = [float(np.asarray(getattr(stats[n], field))) for n in names]
    label, color = _FIELDS[field]
    ax.barh(y + i * height, values, height=height, color=color, label=label)
  ax.set_yticks(y + height * (len(fields) - 1) / 2)
  ax.set_yticklabels(names)
  ax.invert_yaxis()  # first layer on top
  ax.set_xlim(0, 1)
  ax.set_xlabel("fraction of gradient values")
  ax.set_title(title)
  ax.legend(loc="lower right", fontsize="small")
  return ax


def plot_loss_scale(
  history: Sequence[float] | np.ndarray,
  *,
  skipped: Sequence[bool] | np.ndarray | None = None,
  min_loss_scale: float | None = None,
  ax: Any = None,
  title: str = "loss scale",
  color: str = "tab:blue",
) -> Any:
  """The loss scale over steps (log2 axis), skipped steps marked.

  Args:
    history: the scale at each step, e.g. ``health.loss_scale`` collected
      from each step's metrics.
    skipped: per step, whether it was skipped (``~state.last_finite``);
      skipped steps are marked with a cross.
    min_loss_scale: drawn as a horizontal line: a curve lying on it with
      skips is a collapse.
    ax: matplotlib axes to draw on (default: a new figure's).
    title: the axes title.
    color: the colour of the scale's line (and of its legend entry).

  Returns:
    The axes drawn on.

  Raises:
    ValueError: for an empty ``history``, a scale that is not positive and
      finite, or a ``skipped`` of another length.
  """
  scales = np.asarray(history, np.float64).reshape(-1)
  if scales.size == 0:
    raise ValueError("history is empty.")
  if not np.all(np.isfinite(scales) & (scales > 0)):
    raise ValueError("history must hold positive finite loss scales.")
  steps = np.arange(scales.size)
  ax = _axes(ax)
  ax.step(steps, scales, where="post", color=color, label="loss scale")
  if skipped is not None:
    mask = np.asarray(skipped, bool).reshape(-1)
    if mask.shape != scales.shape:
      raise ValueError(f"skipped has {mask.size} entries, history {scales.size}.")
    if mask.any():
      ax.plot(steps[mask], scales[mask], "x", color="tab:red", label="skipped step")
  if min_loss_scale is not None:
    ax.axhline(float(min_loss_scale), color="gray", linestyle="--", label="min_loss_scale")
  ax.set_yscale("log", base=2)
  ax.set_xlabel("step")
  ax.set_ylabel("scale")
  ax.set_title(title)
  ax.legend(loc="best", fontsize="small")
  return ax
