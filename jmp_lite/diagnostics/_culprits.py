"""Naming the layers behind a loss-scale collapse, from fetched gradient statistics."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np

from jmp_lite.diagnostics._gradient_stats import GradientStats


class Culprit(NamedTuple):
  """A layer named by :func:`likely_culprits`.

  Attributes:
    name: the group name from :func:`gradient_statistics`.
    problem: ``"non-finite"``, ``"overflow"`` or ``"underflow"``.
    fraction: the fraction of the layer's gradient values with that problem.
    explanation: one sentence for a human; ``str(culprit)`` is
      ``"<name>: <explanation>"``.
  """

  name: str
  problem: str
  fraction: float
  explanation: str

  def __str__(self) -> str:
    return f"{self.name}: {self.explanation}"


def _natural_key(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _nonfinite_boundaries(forward: list[str], fraction: Callable[[str], float]) -> list[Culprit]:
  """The non-finite layers whose next layer in ``forward`` order is finite, last first.

  When every layer is non-finite there is no such boundary inside the network:
  the values were non-finite from the first layer run on, and that layer is
  named.
  """
  if forward and all(fraction(name) > 0 for name in forward):
    name, frac = forward[0], fraction(forward[0])
    others = len(forward) - 1
    return [
      Culprit(
        name,
        "non-finite",
        frac,
        f"{frac:.1%} of its gradients are NaN/inf and so are those of every layer after it "
        f"({others} layer{'s' * (others != 1)}): non-finite values are there from the first "
        "layer run on, so the cause is at or before the first layer run: its input (the "
        "batch, an embedding) or its own forward pass. (A loss that is inf or NaN for "
        "finite outputs looks the same: check the batch and the loss with jnp.isfinite.)",
      )
    ]
  culprits = []
  for i, name in enumerate(forward):
    frac = fraction(name)
    later_finite = i + 1 == len(forward) or fraction(forward[i + 1]) == 0
    if frac > 0 and later_finite:
      before = sum(fraction(n) > 0 for n in forward[:i])
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
  return culprits[::-1]  # closest to the output first


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
     reported if there are several). When every layer is non-finite, the
     first layer run is named: the cause is at or before it (the input).
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
    underflow_threshold: the fraction of underflowing values above which a
      layer is named (default 0.01).
    max_results: at most this many culprits are returned (default 3).

  Returns:
    The culprits, most likely first: non-finite boundaries from the output
    backwards, then overflowing and underflowing layers by fraction; empty
    when no layer has a problem.

  Raises:
    TypeError: if ``stats`` is not a mapping or ``order`` is a string.
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
  culprits = _nonfinite_boundaries(forward, lambda name: value(name, "nonfinite_fraction"))
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
