"""Which layers ran in fp8 and why: the report, the checks and the warning (private).

``linen_fp8`` and ``nnx_fp8`` decide each layer with an
:class:`~jmp_lite.fp8.Fp8Placement` while the model is traced; each decision
is recorded into the innermost :func:`placement_report` scope, a pattern that
matches no layer is an error, and a model in which no layer runs in fp8 gets
an :class:`Fp8PlacementWarning`.

The open reports are ambient (``_REPORT``) because the decisions are taken
inside the calls Flax makes with its own fixed arguments (a linen interceptor's,
an NNX layer's call of its op), which cannot be given the report.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from jmp_lite import _frames
from jmp_lite._context import Ambient
from jmp_lite.fp8._placement import Fp8Placement, describe_pattern, pattern_matches


class Fp8PlacementWarning(UserWarning):
  """No layer of a model runs in fp8 although fp8 was asked for."""


class LayerPlacement(NamedTuple):
  """Where one matmul layer ran, as last traced.

  Attributes:
    path: the layer's module path, names joined by ``"/"``.
    fp8: whether its matmul ran in fp8.
    reason: ``"fp8"``, or why it stayed in the compute dtype.
    shape: its matmul's ``(m, k, n)``, or ``None`` if it was kept before its
      shape was looked at (by a pattern, or as the first or last layer).
  """

  path: str
  fp8: bool
  reason: str
  shape: tuple[int, int, int] | None


class PlacementReport:
  """The layers traced inside a :func:`placement_report` scope, by path (the latest trace wins)."""

  def __init__(self) -> None:
    self.layers: dict[str, LayerPlacement] = {}

  @property
  def fp8(self) -> tuple[str, ...]:
    """The paths of the layers that ran in fp8, in the order first traced."""
    return tuple(p for p, layer in self.layers.items() if layer.fp8)

  @property
  def kept(self) -> dict[str, str]:
    """``{path: reason}`` of the layers kept in the compute dtype."""
    return {p: layer.reason for p, layer in self.layers.items() if not layer.fp8}

  def __str__(self) -> str:
    width = max((len(p) for p in self.layers), default=4)
    lines = [f"{'layer':<{width}}  fp8   reason"]
    for p, layer in self.layers.items():
      lines.append(f"{p:<{width}}  {'yes' if layer.fp8 else 'no ':<4}  {layer.reason}")
    return "\n".join(lines)


_REPORT: Ambient[PlacementReport] = Ambient("jmp_lite.flax.fp8.placement_report")


@contextlib.contextmanager
def placement_report() -> Iterator[PlacementReport]:
  """Records where the fp8 layers traced inside ran, and why the others did not.

  Returns:
    A context manager yielding a :class:`PlacementReport`, filled as the
    model is traced (``init``, ``apply``, a ``jit`` step's first call or
    ``.lower``; a step already compiled traces nothing).
  """
  with _REPORT.scope(PlacementReport()) as report:
    yield report


def record(path: str, reason: str | None, shape: tuple[int, int, int] | None) -> None:
  """Records one layer's decision in the innermost report (if any).

  Args:
    path: the layer's path.
    reason: why it stays in the compute dtype, or ``None`` for fp8.
    shape: its ``(m, k, n)``, if known.
  """
  report = _REPORT.current()
  if report is not None:
    report.layers[path] = LayerPlacement(path, reason is None, reason or "fp8", shape)


def check_patterns(
  placement: Fp8Placement, layers: Mapping[str, tuple[type, ...]], model: str
) -> None:
  """Raises if a pattern of ``placement`` matches none of ``layers``.

  Args:
    placement: the placement.
    layers: ``{path: classes}`` of every layer that could run in fp8.
    model: the model's name, for the message.

  Raises:
    ValueError: naming the patterns and the layers there are.
  """
  unmatched = [
    describe_pattern(p)
    for p in placement.patterns
    if not any(pattern_matches(p, path, classes) for path, classes in layers.items())
  ]
  if unmatched:
    raise ValueError(
      f"Fp8Placement pattern(s) {', '.join(unmatched)} match no matmul layer of {model}; its "
      f"layers that can run in fp8 are: {', '.join(layers) or 'none'}. A pattern is a regular "
      "expression searched in the layer's path, or a module class the layer is or is inside."
    )


def warn_if_no_fp8(reasons: Mapping[str, str | None], model: str) -> None:
  """Warns, at the user's call, when layers could run in fp8 but none does.

  Args:
    reasons: ``{path: reason or None}`` of every layer decided.
    model: the model's name, for the message.
  """
  if not reasons or any(r is None for r in reasons.values()):
    return
  kept = "; ".join(f"{p}: {r}" for p, r in reasons.items())
  warnings.warn(
    f"No matmul of {model} runs in fp8 ({kept}). fp8.Fp8Placement decides where fp8 runs "
    "(its defaults keep the first and last layers and matmuls too small to pay in the compute "
    "dtype); placement=fp8.ALL_LAYERS runs every layer in fp8.",
    Fp8PlacementWarning,
    stacklevel=_frames.SourceFiles().user_stacklevel(2),
  )
