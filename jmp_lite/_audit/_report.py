"""What an audit returns: findings with their source lines, and the report that groups them."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class SourceLocation:
  """A line of Python source: where an operation was written.

  Attributes:
    file: the path of the source file, as JAX recorded it.
    line: the line number in ``file``.
    function: the qualified name of the function, e.g. ``"Attention.__call__"``.
  """

  file: str
  line: int
  function: str

  def __str__(self) -> str:
    path = _short_path(self.file)  # relative to the working directory when below it
    return f"{path}:{self.line} in {self.function}"


def _short_path(path: str) -> str:
  try:
    rel = os.path.relpath(path)
  except ValueError:  # another drive on Windows
    return path
  return path if rel.startswith("..") else rel


@dataclasses.dataclass(frozen=True)
class Finding:
  """One precision-sensitive operation.

  Attributes:
    check: which check fired, a key of :data:`~jmp_lite.AUDIT_CHECKS`.
    primitive: the JAX primitive, e.g. ``"exp"``, ``"reduce_sum"``.
    dtype: the low-precision dtype involved, e.g. ``"float16"`` (for
      ``fp32_matmul``: the compute dtype the matmul should run in).
    operands: the operands' types, e.g. ``("float16[2,4,16,16]",)``.
    results: the results' types.
    message: what goes wrong and how to fix it, with the format's numbers.
    location: the user's source line (the innermost frame outside JAX, the
      Python standard library, installed packages and jmp_lite), or None when
      JAX recorded no traceback.
    library_location: the innermost frame outside JAX when it differs from
      ``location``, e.g. the line of ``flax/linen/attention.py`` that calls
      softmax on behalf of the user's line.
    scope: JAX's name stack, e.g. ``"Transformer/Block_0/Attention_0"`` for
      Flax modules, ``"jvp(...)"``/``"transpose(...)"`` under ``jax.grad``.
    backward: whether the operation belongs to the backward pass.
    size: the number of values reduced / contracted / normalized, or None.
    autodiff: whether JAX's autodiff created the operation rather than the
      code at ``location``: every operation of the backward pass, and the
      forward-pass operations of a derivative (``rsqrt``'s derivative divides
      by its input).
    derivative_of: for ``autodiff`` findings, the operation whose derivative
      this is (``"rsqrt"``), or ``""`` when the traceback does not name it;
      None otherwise.
  """

  check: str
  primitive: str
  dtype: str
  operands: tuple[str, ...]
  results: tuple[str, ...]
  message: str
  location: SourceLocation | None
  library_location: SourceLocation | None = None
  scope: str = ""
  backward: bool = False
  size: int | None = None
  autodiff: bool = False
  derivative_of: str | None = None

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-serializable dict.

    Returns:
      A dict of every field; locations become dicts, tuples become lists.
    """
    out = dataclasses.asdict(self)
    out["operands"], out["results"] = list(self.operands), list(self.results)
    return out

  def __str__(self) -> str:
    where = str(self.location) if self.location else "<unknown location>"
    if self.autodiff:  # not a line the user wrote: say which derivative it is part of
      what = f"the derivative of {self.derivative_of}" if self.derivative_of else "a derivative"
      where = f"created by autodiff: {what} at {where}"
    lines = [f"[{self.check}] {where}"]
    ops = f"{self.primitive} {', '.join(self.operands)} -> {', '.join(self.results)}"
    if self.scope:
      ops += f"  (scope: {self.scope})"
    lines.append(f"    {ops}")
    if self.library_location:
      lines.append(f"    via {self.library_location}")
    lines.extend(textwrap.wrap(self.message, 96, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The findings of :func:`~jmp_lite.audit`: iterable, sized, printable.

  ``len(report)`` is the number of findings, so ``assert not report`` checks
  that a model is clean; ``str(report)`` groups findings by check and source
  line (a model that repeats a layer N times gives one entry with N scopes).

  Attributes:
    findings: the findings, in program order.
    num_operations: how many equations were checked, nested jaxprs included.
    formats: the audited formats' names.
  """

  findings: tuple[Finding, ...]
  num_operations: int
  formats: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.findings)

  def __iter__(self) -> Iterator[Finding]:
    return iter(self.findings)

  @property
  def ok(self) -> bool:
    """True when there is no finding."""
    return not self.findings

  def by_check(self) -> dict[str, tuple[Finding, ...]]:
    """Groups the findings by check.

    Returns:
      ``{check: findings}``, checks in order of first appearance.
    """
    out: dict[str, list[Finding]] = {}
    for f in self.findings:
      out.setdefault(f.check, []).append(f)
    return {k: tuple(v) for k, v in out.items()}

  def to_dicts(self) -> list[dict[str, Any]]:
    """The findings as JSON-serializable dicts (e.g. to store as a CI artifact).

    Returns:
      One :meth:`Finding.to_dict` per finding.
    """
    return [f.to_dict() for f in self.findings]

  def __str__(self) -> str:
    checked = f"checked {self.num_operations} operations for {', '.join(self.formats)}"
    if not self.findings:
      return f"jmp_lite audit: no precision-sensitive operation found ({checked})."
    groups: dict[tuple, list[Finding]] = {}
    for f in self.findings:
      groups.setdefault((f.check, f.location, f.autodiff, f.derivative_of), []).append(f)
    n = len(self.findings)
    sites = f"{len(groups)} site{'s' * (len(groups) != 1)}"
    lines = [f"jmp_lite audit: {n} finding{'s' * (n != 1)} at {sites} ({checked})."]
    for i, group in enumerate(groups.values(), 1):
      lines.append("")
      lines.append(f"{i}. " + str(group[0]))
      if len(group) > 1:
        scopes = sorted({f.scope for f in group[1:] if f.scope})
        more = f"    ... and {len(group) - 1} more at this line"
        lines.append(more + (f" (scopes: {', '.join(scopes)})" if scopes else ""))
    return "\n".join(lines)
