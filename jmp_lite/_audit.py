"""Precision audit: find the operations mixed precision breaks, before a run does.

The implementation of :func:`jmp_lite.audit`; the public names are exported by
``jmp_lite`` (``jl.audit``, ``jl.AuditConfig``, ``jl.AUDIT_CHECKS``...).

:func:`audit` traces a function (a model's ``apply``, a loss, a whole train
step) to a jaxpr and walks every equation, including those of nested jaxprs
(``jit``, ``scan``, ``cond``, ``while``, ``custom_jvp``/``custom_vjp``,
``checkpoint``/``remat``, ``shard_map``). It reports each precision-sensitive
operation that runs in float16, bfloat16 or fp8, with the user's source line::

  report = jl.audit(model.apply, params16, x16)
  print(report)            # grouped, readable
  report.findings          # structured: Finding(check, primitive, dtype, location, ...)

What it looks for (the ``check`` of a :class:`Finding`):

========================  ==================================================================
``softmax``               ``exp(x - max) / sum(exp(x - max))`` with exp or the division in
                          16/8 bits (small probabilities flush to 0; ``log`` of them is -inf)
``logsumexp``             ``log(sum(exp(x)))`` in 16/8 bits (``log_softmax``, cross-entropy)
``exp``                   any other ``exp``/``exp2``/``expm1`` (fp16 overflows above
                          :math:`\\ln 65504 \\approx 11.1`)
``log``                   ``log``/``log1p`` (an input that underflowed to 0 gives -inf)
``logistic``              a sigmoid whose result reaches a ``log`` (log-sigmoid losses)
``reduction``             ``reduce_sum``/``reduce_prod``/``cumsum``/``cumprod``/
                          ``cumlogsumexp`` over at least ``long_reduction`` values
``normalization``         normalization statistics: ``x**2`` feeding a reduction in a
                          narrow-range format, ``rsqrt``/``sqrt`` of a reduction
``division``              a division by a reduction (``x / sum(x)``, ``x / norm(x)``)
``matmul``                ``dot_general``/``conv`` whose result (the only accumulation type
                          a jaxpr states) is fp8, or 16-bit with ``matmul_accumulation=
                          "as_written"``
``cast``                  a cast to float16/fp8 of values that do not fit: finite constants
                          beyond the format's max (``-1e9`` masks), results of range-expanding
                          operations (``exp``, powers, long sums, and means of them),
                          unclipped casts to fp8
``fp32_matmul``           a forward-pass ``dot_general``/``conv`` with float32 operands while
                          the compute dtype is 16/8-bit (a layer built with
                          ``dtype=jnp.float32`` under a bf16 policy runs in float32); only
                          with a known compute dtype: :attr:`AuditConfig.compute_dtype`, or
                          the ``policy`` of a function from ``jmp_lite.flax.policy_apply``
========================  ==================================================================

The long-reduction threshold is :math:`1/\\epsilon` of the format (128 for
bfloat16, 1024 for float16): from there on each added term is smaller than the
rounding error of a running sum, so a sequential accumulation starts dropping
terms. Range checks (``cast``, ``x**2`` overflow) apply only to formats whose
range is narrower than float32's (float16, fp8): bfloat16 has float32's exponent.

A *correct* policy (softmax, losses and normalization statistics in float32,
matmuls and elementwise work in 16 bits) produces no finding; the audit is
meant to be run in a test so that regressions are caught.

Operations of the backward pass (``transpose`` in the name stack, created by
``jax.grad``) are skipped unless ``include_backward=True``: they mirror the
forward operations (fix the forward op and its transpose follows), and the
range of gradients is what :mod:`jmp_lite.diagnostics` and loss scaling cover.
Forward-pass operations that a derivative rule added (the division in
``rsqrt``'s derivative ``-0.5 * rsqrt(x) / x``) are reported, marked
:attr:`Finding.autodiff` with the operation they differentiate
(:attr:`Finding.derivative_of`): the user's line did not write them, and moving
that operation to float32 moves its derivative too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import os
import sysconfig
import textwrap
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _jaxpr
from jmp_lite._policy import Policy

__all__ = [
  "AUDIT_CHECKS",
  "AuditConfig",
  "AuditReport",
  "Finding",
  "SourceLocation",
  "audit",
  "audit_jaxpr",
]

AUDIT_CHECKS: dict[str, str] = {
  "softmax": "exp / sum(exp) normalization in 16/8 bits",
  "logsumexp": "log(sum(exp(x))) (log_softmax, cross-entropy) in 16/8 bits",
  "exp": "exp, exp2, expm1 in 16/8 bits",
  "log": "log, log1p in 16/8 bits",
  "logistic": "sigmoid feeding a log in 16/8 bits",
  "reduction": "sum, product or cumulative sum over a long axis in 16/8 bits",
  "normalization": "variance / RMS statistics or rsqrt of a reduction in 16/8 bits",
  "division": "division by a reduction in 16/8 bits",
  "matmul": "dot_general / convolution without a wide result type",
  "cast": "cast to float16 / fp8 of values beyond the format's range",
  "fp32_matmul": "dot_general / convolution in float32 while the compute dtype is 16/8-bit",
}
"""The checks :func:`~jmp_lite.audit` runs, by name (all are enabled by default)."""

_DEFAULT_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_MATMUL_MODES = ("assume_fp32", "as_written")

# Ops that only move or re-type values: patterns are matched through them.
_TRANSPARENT = _jaxpr.TRANSPARENT
# Ops a denominator or a variance may pass through between its reduction and
# its use: ``var + eps``, ``mean = sum / n``, ``sqrt``, ``max(norm, eps)``.
_STATS_THROUGH = _TRANSPARENT | {"add", "sub", "mul", "div", "max", "sqrt", "rsqrt", "integer_pow"}
_REDUCTIONS = frozenset(
  {"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_max", "reduce_min"}
)
_ACCUMULATING = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
_SAME_VALUES = _TRANSPARENT | {
  "slice",
  "dynamic_slice",
  "gather",
  "reduce_max",
  "reduce_min",
  "cummax",
  "cummin",
  "rev",
  "sort",
}
# Ops whose result is one of some operands' values: (first, end) of those operands.
_UNION_OF_OPERANDS = {
  "concatenate": (0, None),
  "select_n": (1, None),  # the cases, not the predicate
  "pad": (0, 2),  # the operand and the padding value
  "dynamic_update_slice": (0, 2),  # the operand and the update, not the indices
}
_BOUNDED = {
  "tanh": (-1.0, 1.0),
  "logistic": (0.0, 1.0),
  "sin": (-1.0, 1.0),
  "cos": (-1.0, 1.0),
  "erf": (-1.0, 1.0),
  "sign": (-1.0, 1.0),
  "atan": (-math.pi / 2, math.pi / 2),
  "atan2": (-math.pi, math.pi),
}


# --------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True)
class SourceLocation:
  """A line of Python source: where an operation was written."""

  file: str
  line: int
  function: str

  def __str__(self) -> str:
    return f"{_short_path(self.file)}:{self.line} in {self.function}"


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
    operands: the operands' types, e.g. ``("f16[2,4,16,16]",)``.
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
    """A JSON-serializable dict of the fields."""
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
  """The findings of :func:`audit`: iterable, sized, printable.

  ``len(report)`` is the number of findings, so ``assert not report`` checks
  that a model is clean; ``str(report)`` groups findings by check and source
  line (a model that repeats a layer N times gives one entry with N scopes).
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
    """Findings grouped by :attr:`Finding.check`, in order of first appearance."""
    out: dict[str, list[Finding]] = {}
    for f in self.findings:
      out.setdefault(f.check, []).append(f)
    return {k: tuple(v) for k, v in out.items()}

  def to_dicts(self) -> list[dict[str, Any]]:
    """The findings as JSON-serializable dicts (e.g. to store as a CI artifact)."""
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


# --------------------------------------------------------------------------------------------
# Configuration


def _str_tuple(value: Any, name: str) -> tuple[str, ...]:
  if isinstance(value, str) or not isinstance(value, Collection):
    raise TypeError(f"{name} must be a collection of strings, got {value!r}.")
  for item in value:
    if not isinstance(item, str):
      raise TypeError(f"{name} must contain strings, got {item!r} in {value!r}.")
  return tuple(value)


def _positive_int(value: Any, name: str) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int or None, got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}.")
  return int(value)


@dataclasses.dataclass(frozen=True)
class AuditConfig:
  """What :func:`audit` checks, its thresholds and allow-lists.

  Attributes:
    formats: the low-precision formats to audit (names or dtypes, each
      narrower than 32 bits). Default: float16, bfloat16 and both fp8 formats.
    checks: the checks to run, names from :data:`~jmp_lite.AUDIT_CHECKS` (default: all).
    long_reduction: a sum/product/cumulative sum in a low-precision format is
      reported from this many reduced values on. Default (None): per format,
      :math:`1/\\epsilon` (128 for bfloat16, 1024 for float16, 8 for e4m3).
    long_contraction: with ``matmul_accumulation="as_written"``, a matmul is
      reported from this contraction length on (default: per format,
      :math:`1/\\epsilon`).
    matmul_accumulation: ``"assume_fp32"`` (default): XLA accumulates
      float16/bfloat16 dot products in float32 on CPU, GPU (cuBLAS) and TPU
      (the MXU), so only matmuls whose result is fp8 are reported.
      ``"as_written"``: trust only the jaxpr, where the result type is the only
      stated accumulation type; every long 16/8-bit-result matmul is reported
      (use it for backends that accumulate in the result type).
    include_backward: also report operations of the backward pass.
    allow_primitives: primitives never reported, e.g. ``("logistic",)``.
    allow_locations: ``fnmatch`` patterns matched against ``"path:line"``,
      ``"path"``, ``"file.py:line"`` and ``"file.py"`` of a finding's location
      and library location, e.g. ``("my_model.py:42", "*/flax/linen/attention.py")``.
    allow_scopes: ``fnmatch`` patterns matched against a finding's scope
      (Flax module path), e.g. ``("*/Head_0*",)``.
    allow: a predicate; findings for which it returns True are dropped.
    library_paths: extra directories whose frames count as library code when
      finding the user's line (installed packages, the Python standard
      library, JAX and jmp_lite always do).
    compute_dtype: the dtype the program is meant to compute in (a name or
      dtype), for the ``fp32_matmul`` check: with a 16/8-bit compute dtype,
      forward-pass matmuls with float32 operands are reported. Default (None):
      the compute dtype of the audited function's ``policy`` attribute (a
      :class:`~jmp_lite.Policy`, as on the function ``jmp_lite.flax.policy_apply``
      returns), and no ``fp32_matmul`` check when there is none.
  """

  formats: Sequence[Any] = _DEFAULT_FORMATS
  checks: Collection[str] = tuple(AUDIT_CHECKS)
  long_reduction: int | None = None
  long_contraction: int | None = None
  matmul_accumulation: str = "assume_fp32"
  include_backward: bool = False
  allow_primitives: Collection[str] = ()
  allow_locations: Collection[str] = ()
  allow_scopes: Collection[str] = ()
  allow: Callable[[Finding], bool] | None = None
  library_paths: Collection[str] = ()
  compute_dtype: Any = None

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    if isinstance(self.formats, (str, np.dtype)) or not isinstance(self.formats, Collection):
      raise TypeError(f"formats must be a sequence of dtype names, got {self.formats!r}.")
    formats = []
    for value in self.formats:
      dtype = dtypes.parse_dtype(value)
      if dtype.itemsize >= 4:
        raise ValueError(
          f"formats lists the low-precision formats to audit; {dtype.name} (from {value!r}) is "
          "not narrower than 32 bits."
        )
      formats.append(dtype.name)
    set_("formats", tuple(dict.fromkeys(formats)))
    checks = _str_tuple(self.checks, "checks")
    unknown = sorted(set(checks) - set(AUDIT_CHECKS))
    if unknown:
      raise ValueError(f"Unknown checks {unknown}; known checks: {', '.join(AUDIT_CHECKS)}.")
    set_("checks", frozenset(checks))
    set_("long_reduction", _positive_int(self.long_reduction, "long_reduction"))
    set_("long_contraction", _positive_int(self.long_contraction, "long_contraction"))
    if self.matmul_accumulation not in _MATMUL_MODES:
      raise ValueError(
        f"matmul_accumulation must be one of {_MATMUL_MODES}, got {self.matmul_accumulation!r}."
      )
    if not isinstance(self.include_backward, bool):
      raise TypeError(f"include_backward must be a bool, got {self.include_backward!r}.")
    for name in ("allow_primitives", "allow_locations", "allow_scopes", "library_paths"):
      set_(name, _str_tuple(getattr(self, name), name))
    if self.allow is not None and not callable(self.allow):
      raise TypeError(f"allow must be a callable taking a Finding, got {self.allow!r}.")
    if self.compute_dtype is not None:
      try:
        set_("compute_dtype", dtypes.parse_dtype(self.compute_dtype).name)
      except (TypeError, ValueError) as e:
        raise type(e)(f"compute_dtype={self.compute_dtype!r}: {e}") from e

  def _threshold(self, dtype: np.dtype, override: int | None) -> int:
    if override is not None:
      return override
    return round(1 / dtypes.format_info(dtype).epsilon)

  def _allowed(self, finding: Finding) -> bool:
    if finding.primitive in self.allow_primitives:
      return True
    for loc in (finding.location, finding.library_location):
      if loc is not None:
        base = os.path.basename(loc.file)
        keys = (f"{loc.file}:{loc.line}", loc.file, f"{base}:{loc.line}", base)
        if any(fnmatch.fnmatch(k, p) for k in keys for p in self.allow_locations):
          return True
    if any(fnmatch.fnmatch(finding.scope, p) for p in self.allow_scopes):
      return True
    return bool(self.allow is not None and self.allow(finding))


# --------------------------------------------------------------------------------------------
# Source locations


# JAX's own files, relative to the jax package, that only bind, trace or call
# functions: frames in them say nothing about who created an operation.
_JAX_PLUMBING = frozenset(
  {
    "_src/api.py",
    "_src/api_util.py",
    "_src/core.py",
    "_src/dispatch.py",
    "_src/linear_util.py",
    "_src/pjit.py",
    "_src/source_info_util.py",
    "_src/traceback_util.py",
    "_src/tree_util.py",
    "_src/util.py",
  }
)
_JAX_AD = "_src/interpreters/ad.py"  # the JVP/linearize trace that runs derivative rules
_JAX_CUSTOM_RULES = "_src/custom_derivatives.py"  # custom_jvp/custom_vjp: rules users write


def _bare_name(function_name: str) -> str | None:
  """``"rsqrt"`` for ``"_rsqrt"``; None for ``"f.<locals>.g"``, ``"<lambda>"``, methods."""
  name = function_name.lstrip("_")
  return name if name.isidentifier() else None


def _binds(function_name: str, primitive: str) -> bool:
  """Whether a JAX function of that name binds that primitive (``lax.select`` binds
  ``select_n``; ``_convert_element_type_bind_with_trace``, ``convert_element_type``)."""
  name = function_name.lstrip("_")
  return bool(name) and (name.startswith(primitive) or primitive.startswith(name))


class _FrameFilter:
  """Classifies source files: JAX internals, other libraries, or the user's code."""

  def __init__(self, library_paths: Collection[str]):
    def norm(p):
      return os.path.join(os.path.realpath(p), "")

    self._internal = tuple(
      norm(os.path.dirname(str(m.__file__))) for m in (jax, jaxlib) if getattr(m, "__file__", None)
    )
    self._jax = norm(os.path.dirname(str(jax.__file__)))
    self._jax_files: dict[str, str | None] = {}
    stdlib = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} - {None}
    self._stdlib = tuple(norm(p) for p in stdlib)
    here = os.path.dirname(os.path.abspath(__file__))  # jmp_lite itself
    self._libraries = (*(norm(p) for p in library_paths), norm(here))
    self._cache: dict[str, str] = {}

  def kind(self, filename: str) -> str:
    """One of "internal" (JAX, stdlib), "library" or "user"."""
    kind = self._cache.get(filename)
    if kind is None:
      kind = self._cache[filename] = self._classify(filename)
    return kind

  def _classify(self, filename: str) -> str:
    if filename.startswith("<frozen"):
      return "internal"
    if filename.startswith("<"):  # <string>, <stdin>, notebooks: the user's code
      return "user"
    path = os.path.realpath(filename)
    if path.startswith(self._internal):
      return "internal"
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts or path.startswith(self._libraries):
      return "library"
    if path.startswith(self._stdlib):
      return "internal"
    return "user"

  def locate(self, traceback: Any) -> tuple[SourceLocation | None, SourceLocation | None]:
    """(user location, library location) of a JAX traceback; innermost frames first."""
    if traceback is None:
      return None, None
    user = library = None
    for frame in traceback.frames:
      kind = self.kind(frame.file_name)
      if kind == "internal":
        continue
      loc = SourceLocation(frame.file_name, frame.line_num, frame.function_name)
      if library is None:
        library = loc
      if kind == "user":
        user = loc
        break
    return user, (library if library != user else None)

  def _jax_file(self, filename: str) -> str | None:
    """The path of a JAX source file relative to the jax package ("_src/core.py"), else None."""
    if filename not in self._jax_files:
      path = os.path.realpath(filename)
      rel = path[len(self._jax) :].replace(os.sep, "/") if path.startswith(self._jax) else None
      self._jax_files[filename] = rel
    return self._jax_files[filename]

  def _plumbing(self, rel: str) -> bool:
    return rel in _JAX_PLUMBING or (rel.startswith("_src/interpreters/") and rel != _JAX_AD)

  def derivative_of(self, traceback: Any, primitive: str, differentiated: bool) -> tuple[bool, str]:
    """Whether a derivative rule created an operation, and which operation it differentiates.

    Two traceback shapes, innermost frame first:

    * Traced by the JVP/linearize trace (``jax.grad`` of code outside ``jit``):
      ``bind <- [lax wrapper <- derivative rule] <- ad.py <- bind <- lax.rsqrt
      <- user``. A JAX frame between the operation and ``ad.py`` that is not
      plumbing (nor the primitive's own ``bind`` wrapper) is the rule; the
      primal itself is bound by ``ad.py`` (or ``pjit``'s rule) directly. A frame
      of user code or of a ``custom_jvp`` rule there means the user wrote it.
    * Inside a differentiated ``jit``/``scan``/``checkpoint``, JAX gives a
      rule's operations the traceback of the operation they differentiate:
      the innermost ``jax/_src/lax`` function names another primitive
      (``div`` under ``lax.rsqrt``).

    Returns ``(created_by_a_rule, name)``; ``name`` is the differentiated
    operation (``"rsqrt"``, ``"mean"``) or ``""`` when no frame names it.
    """
    if traceback is None:
      return False, ""
    frames = [(self._jax_file(f.file_name), f.function_name) for f in traceback.frames]
    ad = next((i for i, (rel, _) in enumerate(frames) if rel == _JAX_AD), None)
    if ad is None:
      if not differentiated:
        return False, ""
      for rel, function in frames:
        if rel is None or not self._plumbing(rel):
          name = _bare_name(function) if rel is not None and rel.startswith("_src/lax/") else None
          return bool(name and not _binds(name, primitive)), name or ""
      return False, ""
    rule = []
    for rel, function in frames[:ad]:
      if rel is None or rel == _JAX_CUSTOM_RULES:
        return False, ""  # the user's code (or a custom_jvp rule) bound it
      if not self._plumbing(rel):
        rule.append(function)
    # The primitive's own binding wrappers (_convert_element_type_bind_with_trace).
    while rule and _binds(rule[0], primitive) and "jvp" not in rule[0]:
      rule.pop(0)
    name = ""
    for rel, function in frames[ad:]:
      if rel is None:
        break
      if rel == _JAX_AD or self._plumbing(rel):
        continue
      bare = _bare_name(function)
      if bare and (rel.startswith("_src/lax/") or not function.startswith("_")):
        name = bare
        break
    return bool(rule), name


# --------------------------------------------------------------------------------------------
# Value ranges: an interval per value, to tell which casts can overflow


class _Range(NamedTuple):
  lo: float
  hi: float
  # Set when an operation that expands the range (exp, powers, long sums)
  # produced the value and its bounds are unknown; the string names that op.
  expanded_by: str | None = None
  # When the only expansion is a sum of this many values: dividing by at least
  # as much (a mean) gives back values within the summands' range.
  growth: float = 0.0

  @property
  def magnitude(self) -> float:
    return max(abs(self.lo), abs(self.hi))

  @property
  def bounded(self) -> bool:
    return math.isfinite(self.lo) and math.isfinite(self.hi)


_UNKNOWN = _Range(-math.inf, math.inf)


_MAX_CONST_SIZE = 1 << 20  # larger constants (closed-over weights) are not read back


def _range_of_value(value: Any) -> _Range:
  if np.size(value) > _MAX_CONST_SIZE:
    return _UNKNOWN
  try:
    arr = np.asarray(value)
    if arr.size == 0 or not (arr.dtype.kind in "biu" or jnp.issubdtype(arr.dtype, jnp.floating)):
      return _UNKNOWN
    arr = arr.astype(np.float64)
  except Exception:  # an opaque constant such as a PRNG key
    return _UNKNOWN
  finite = arr[~np.isnan(arr)]
  if finite.size == 0:
    return _UNKNOWN
  return _Range(float(finite.min()), float(finite.max()))


def _union(*ranges: _Range) -> _Range:
  expanded = next((r.expanded_by for r in ranges if r.expanded_by), None)
  return _Range(min(r.lo for r in ranges), max(r.hi for r in ranges), expanded)


def _mul_bounds(a: _Range, b: _Range) -> tuple[float, float]:
  prods = []
  for x in (a.lo, a.hi):
    for y in (b.lo, b.hi):
      prods.append(0.0 if x == 0 or y == 0 else x * y)  # 0 * inf is 0 for bounds
  return min(prods), max(prods)


def _safe(fn: Callable[[float], float], x: float, default: float) -> float:
  try:
    return fn(x)
  except (OverflowError, ValueError, ZeroDivisionError):
    return default


def _expanded(*ranges: _Range) -> str | None:
  return next((r.expanded_by for r in ranges if r.expanded_by), None)


def _divided(a: _Range, lo: float, hi: float, divisor: float) -> _Range:
  """The range ``[lo, hi]`` of ``a / d`` with ``|d| >= divisor``: what made ``a``
  overflow-prone (an exp, a power) still does, except a sum's growth that a
  division by the number of summands (a mean) undoes."""
  if a.growth and divisor >= a.growth:
    return _Range(lo, hi)
  return _Range(lo, hi, a.expanded_by, a.growth / divisor if a.growth else 0.0)


# --------------------------------------------------------------------------------------------
# The walk


class _Graph:
  """Producers and consumers of the variables of one jaxpr."""

  def __init__(self, jaxpr: Any):
    self.producer: dict[Any, Any] = {}
    self.consumers: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        self.producer[v] = eqn
      for v in eqn.invars:
        if not _jaxpr.is_literal(v):
          self.consumers.setdefault(v, []).append(eqn)

  def sources(self, atom: Any, through: Collection[str]) -> Iterator[Any]:
    """The producers reachable back from ``atom`` through ``through`` ops
    (all operands; only the cases of a ``select_n``)."""
    todo: list[Any] = [atom]
    seen: set[Any] = set()
    while todo and len(seen) < 64:
      a = todo.pop()
      if _jaxpr.is_literal(a) or a in seen:
        continue
      seen.add(a)
      eqn = self.producer.get(a)
      if eqn is None:
        continue
      name = eqn.primitive.name
      if name in through or name == "select_n":
        todo.extend(eqn.invars[1:] if name == "select_n" else eqn.invars)
      else:
        yield eqn

  def forward(self, var: Any) -> list[Any]:
    """``var`` and the variables derived from it through transparent ops."""
    out: list[Any] = []
    todo: list[Any] = [var]
    while todo and len(out) < 64:
      v = todo.pop()
      out.append(v)
      for eqn in self.consumers.get(v, ()):
        if eqn.primitive.name in _TRANSPARENT:
          todo.extend(eqn.outvars)
    return out

  def back(self, atom: Any, through: Collection[str]) -> tuple[Any | None, list[Any], Any]:
    """Follows ``atom`` back through ``through`` ops (along their first operand
    that is not a literal). Returns the first other producer (or None), the
    eqns passed through, and the variable that producer outputs."""
    chain: list[Any] = []
    for _ in range(32):
      if _jaxpr.is_literal(atom):
        return None, chain, atom
      eqn = self.producer.get(atom)
      if eqn is None or eqn.primitive.name not in through:
        return eqn, chain, atom
      chain.append(eqn)
      atoms = [a for a in eqn.invars if not _jaxpr.is_literal(a)]
      if not atoms:
        return None, chain, atom
      atom = atoms[0]
    return None, chain, atom


class _Context(NamedTuple):
  scope: str
  backward: bool
  location: SourceLocation | None
  library_location: SourceLocation | None
  # Inside jax.grad/jvp (a "jvp(" or "transpose(" name stack here or above).
  differentiated: bool = False
  # Inside a call (jit, scan...) that is itself differentiated.
  in_differentiated_call: bool = False
  traceback: Any = None


def _aval_str(atom: Any) -> str:
  aval = getattr(atom, "aval", None)
  return aval.str_short() if aval is not None else repr(atom)


def _dtype(atom: Any) -> np.dtype | None:
  """The numpy dtype of a jaxpr atom; None for tokens and extended dtypes (PRNG keys)."""
  dtype = getattr(getattr(atom, "aval", None), "dtype", None)
  try:
    return np.dtype(dtype) if dtype is not None else None
  except TypeError:
    return None


def _shape(atom: Any) -> tuple[int, ...]:
  return tuple(getattr(getattr(atom, "aval", None), "shape", ()))


def _states_wide_accumulation(eqn) -> bool:
  """Whether a dot's algorithm preset states an fp32 (or wider) accumulator."""
  precision = eqn.params.get("precision")
  if not isinstance(precision, lax.DotAlgorithmPreset):
    return False
  accumulation = precision.accumulation_type
  return accumulation is not None and np.dtype(accumulation).itemsize >= 4


def _contraction_size(eqn: Any) -> int:
  """The number of products summed into each result of a dot_general / convolution."""
  lhs, rhs = eqn.invars[:2]
  if eqn.primitive.name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    return math.prod(_shape(lhs)[d] for d in lhs_contract)
  out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
  shape = _shape(rhs)
  return math.prod(shape) // max(shape[out_feature_dim], 1)


class _Auditor:
  def __init__(self, config: AuditConfig):
    self.config = config
    self.formats = {np.dtype(jnp.dtype(f)) for f in config.formats}
    # The 16/8-bit dtype matmuls should run in (fp32_matmul), if known and audited.
    compute = None if config.compute_dtype is None else np.dtype(jnp.dtype(config.compute_dtype))
    self.compute_dtype = compute if compute in self.formats else None
    self.frames = _FrameFilter(config.library_paths)
    self.findings: list[Finding] = []
    self.num_operations = 0
    self._graphs: dict[int, tuple[Any, _Graph]] = {}

  # -- helpers ------------------------------------------------------------------------------

  def graph(self, jaxpr: Any) -> _Graph:
    entry = self._graphs.get(id(jaxpr))
    if entry is None or entry[0] is not jaxpr:
      entry = self._graphs[id(jaxpr)] = (jaxpr, _Graph(jaxpr))
    return entry[1]

  def low(self, atom: Any) -> np.dtype | None:
    dtype = _dtype(atom)
    return dtype if dtype in self.formats else None

  @staticmethod
  def narrow_range(dtype: np.dtype) -> bool:
    # bfloat16 shares float32's exponent: range checks do not apply to it.
    return dtypes.format_info(dtype).max < 1e38

  def reduction_origin(self, graph: _Graph, atom: Any) -> tuple[Any, list[Any]]:
    """The sum/product a statistic comes from, and the eqns in between.

    Searches back from ``atom`` through transparent ops, ``select_n`` cases and
    at most three arithmetic steps (``var + eps``, ``sum / n``, ``sqrt``,
    ``E[x^2] - E[x]^2``), into calls such as ``jnp.var``'s jit and back out of
    them. The budget keeps an ordinary activation (which, far enough back,
    always comes from some LayerNorm's statistics) from counting as one.
    """
    # (graph, atom, eqns passed, arithmetic steps, the calls we are inside of)
    stack: list[tuple[_Graph, Any, list[Any], int, tuple]] = [(graph, atom, [], 0, ())]
    seen: set[tuple[int, Any]] = set()
    while stack and len(seen) < 128:
      g, a, chain, steps, calls = stack.pop()
      if _jaxpr.is_literal(a) or (id(g), a) in seen:
        continue
      seen.add((id(g), a))
      eqn = g.producer.get(a)
      if eqn is None:  # an input of a called jaxpr: continue at the call's operand
        if calls:
          outer, jaxpr, bindings = calls[-1]
          operand = bindings[list(jaxpr.invars).index(a)] if a in jaxpr.invars else None
          if operand is not None:
            stack.append((outer, operand, chain, steps, calls[:-1]))
        continue
      name = eqn.primitive.name
      if name in _ACCUMULATING:
        return eqn, chain
      free = name in _TRANSPARENT or name == "select_n"
      if free or (name in _STATS_THROUGH and steps < 3):
        operands = eqn.invars[1:] if name == "select_n" else eqn.invars
        for op in reversed(operands):
          stack.append((g, op, [*chain, eqn], steps + (not free), calls))
        continue
      if len(calls) < 4:
        for sub in _jaxpr.sub_jaxprs(eqn):
          if sub.returns_outputs:  # e.g. jnp.var's jit: look inside
            inner = sub.jaxpr.outvars[list(eqn.outvars).index(a)]
            call = (g, sub.jaxpr, sub.bindings)
            stack.append((self.graph(sub.jaxpr), inner, [*chain, eqn], steps, (*calls, call)))
    return None, []

  def add(self, ctx: _Context, check: str, eqn: Any, dtype: np.dtype, message: str, size=None):
    if check not in self.config.checks:
      return
    if ctx.backward and not self.config.include_backward:
      return
    derivative_of = self.derivative_of(eqn, ctx)
    if derivative_of:
      message += (
        f" JAX's autodiff created this operation for the derivative of {derivative_of}: "
        f"computing {derivative_of} in float32 moves its derivative to float32 too."
      )
    finding = Finding(
      check=check,
      primitive=eqn.primitive.name,
      dtype=dtype.name,
      operands=tuple(_aval_str(a) for a in eqn.invars),
      results=tuple(_aval_str(a) for a in eqn.outvars),
      message=message,
      location=ctx.location,
      library_location=ctx.library_location,
      scope=ctx.scope,
      backward=ctx.backward,
      size=None if size is None else int(size),
      autodiff=derivative_of is not None,
      derivative_of=derivative_of,
    )
    if not self.config._allowed(finding):
      self.findings.append(finding)

  def context(self, parent: _Context, eqn: Any) -> _Context:
    info = eqn.source_info
    name = str(info.name_stack) if info is not None else ""
    scope = "/".join(s for s in (parent.scope, name) if s)
    traceback = getattr(info, "traceback", None)
    user, library = self.frames.locate(traceback)
    if user is None:  # e.g. equations JAX traced inside jnp.var: keep the caller's line
      user, library = parent.location, library or parent.library_location
    # JAX renders the backward pass as "transpose(jvp(...))" in name stacks.
    backward = parent.backward or "transpose(" in name
    differentiated = parent.differentiated or backward or "jvp(" in name
    return _Context(
      scope, backward, user, library, differentiated, parent.differentiated, traceback
    )

  def derivative_of(self, eqn: Any, ctx: _Context) -> str | None:
    """None when the user's code wrote ``eqn``; when autodiff created it, the
    operation it differentiates (``""`` when unknown). Only asked of findings."""
    if not ctx.differentiated:
      return None
    created, name = False, ""
    # A call or loop (jit, scan) holds both a primal and its derivative: its
    # equations are judged one by one.
    if not _jaxpr.sub_jaxprs(eqn):
      created, name = self.frames.derivative_of(
        ctx.traceback, eqn.primitive.name, ctx.in_differentiated_call
      )
    return name if created or ctx.backward else None

  # -- walk ---------------------------------------------------------------------------------

  def visit(self, jaxpr: Any, consts: Sequence[Any], in_ranges: Sequence[_Range], ctx: _Context):
    graph = self.graph(jaxpr)
    env: dict[Any, _Range] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=False):
      env[v] = _range_of_value(c)
    for v, r in zip(jaxpr.invars, in_ranges, strict=False):
      env[v] = r

    def rng(atom):
      if _jaxpr.is_literal(atom):
        return _range_of_value(atom.val)
      return env.get(atom, _UNKNOWN)

    covered: set[int] = set()
    for eqn in jaxpr.eqns:
      self.num_operations += 1
      eqn_ctx = self.context(ctx, eqn)
      ranges = [rng(a) for a in eqn.invars]
      if id(eqn) not in covered:
        self.check(eqn, graph, ranges, eqn_ctx, covered)
      outs = None
      branches = []
      for sub in _jaxpr.sub_jaxprs(eqn):
        inner_in = [_UNKNOWN if b is None else rng(b) for b in sub.bindings]
        inner_out = self.visit(sub.jaxpr, sub.consts, inner_in, eqn_ctx)
        if sub.returns_outputs:
          outs = inner_out
        elif eqn.primitive.name == "cond" and len(inner_out) == len(eqn.outvars):
          branches.append(inner_out)
      if outs is None and branches:  # cond: the result is one of its branches' results
        outs = [_union(*rs) for rs in zip(*branches, strict=True)]
      if outs is None:
        outs = [self.transfer(eqn, graph, ranges)] * len(eqn.outvars)
      for v, r in zip(eqn.outvars, outs, strict=False):
        env[v] = r
    return [rng(v) for v in jaxpr.outvars]

  # -- range transfer -----------------------------------------------------------------------

  def transfer(self, eqn: Any, graph: _Graph, ranges: list[_Range]) -> _Range:
    name = eqn.primitive.name
    out_dtype = _dtype(eqn.outvars[0]) if eqn.outvars else None
    if out_dtype is None or not jnp.issubdtype(out_dtype, jnp.floating) or not ranges:
      return _UNKNOWN
    r = ranges[0]
    src = _dtype(eqn.invars[0])
    if name == "convert_element_type" and src is not None and src.itemsize < 4:
      if jnp.issubdtype(src, jnp.floating) and self.narrow_range(src):
        # A float16/fp8 value fits its format or is inf already: whatever made
        # it overflow-prone was judged where it was computed in that format.
        m = dtypes.format_info(src).max
        return _Range(max(r.lo, -m), min(r.hi, m)) if r.bounded else _UNKNOWN
    if name in _SAME_VALUES:
      return r
    if name in _UNION_OF_OPERANDS:
      first, end = _UNION_OF_OPERANDS[name]
      return _union(*ranges[first:end])
    if name in _BOUNDED:
      return _Range(*_BOUNDED[name])
    if name == "neg":
      return _Range(-r.hi, -r.lo, r.expanded_by, r.growth)
    if name == "abs":
      lo = 0.0 if r.lo <= 0 <= r.hi else min(abs(r.lo), abs(r.hi))
      return _Range(lo, r.magnitude, r.expanded_by)
    if name in ("add", "sub"):
      a, b = ranges
      if name == "sub":
        b = _Range(-b.hi, -b.lo, b.expanded_by)
      return _Range(a.lo + b.lo, a.hi + b.hi, _expanded(a, b))
    if name == "mul":
      a, b = eqn.invars
      if a is b and not _jaxpr.is_literal(a) and not r.bounded:  # x * x: a square
        return _Range(0.0, math.inf, r.expanded_by or "x * x")
      lo, hi = _mul_bounds(*ranges)
      for x, c in (ranges, ranges[::-1]):
        if x.growth and c.lo == c.hi and c.lo != 0:  # sum * (1 / n)
          return _divided(x, lo, hi, 1 / abs(c.lo))
      return _Range(lo, hi, _expanded(*ranges))
    if name == "div":
      a, b = ranges
      # A mean of exp or of x**2 (sum / n) can overflow as the sum can.
      if b.bounded and not b.lo <= 0 <= b.hi:  # e.g. sum / n
        lo, hi = _mul_bounds(a, _Range(1 / b.hi, 1 / b.lo))
        return _divided(a, lo, hi, min(abs(b.lo), abs(b.hi)))
      return _Range(-math.inf, math.inf, a.expanded_by)
    if name in ("max", "min"):
      a, b = ranges
      pick = max if name == "max" else min
      return _Range(pick(a.lo, b.lo), pick(a.hi, b.hi), _expanded(a, b))
    if name == "clamp":
      low, x, high = ranges
      lo, hi = max(low.lo, min(x.lo, high.hi)), min(high.hi, max(x.hi, low.lo))
      return _Range(lo, hi, _expanded(x, low, high))
    if name in ("exp", "exp2", "expm1"):
      base = {"exp": math.exp, "exp2": lambda x: 2.0**x, "expm1": math.expm1}[name]
      if self.nonpositive_argument(graph, eqn):
        r = _Range(r.lo, min(r.hi, 0.0))
      hi = _safe(base, r.hi, math.inf)
      return _Range(_safe(base, r.lo, 0.0), hi, name if hi == math.inf else None)
    if name in ("square", "integer_pow"):
      y = eqn.params.get("y", 2)
      if r.bounded and (y > 0 or not r.lo <= 0 <= r.hi):
        vals = [_safe(lambda v: v**y, v, math.inf) for v in (r.lo, r.hi)]
        lo = 0.0 if y % 2 == 0 and r.lo <= 0 <= r.hi else min(vals)
        return _Range(lo, max(vals))
      lo = 0.0 if y % 2 == 0 else -math.inf  # even powers are >= 0
      return _Range(lo, math.inf, r.expanded_by or (name if y >= 2 else None))
    if name == "sqrt":
      return _Range(math.sqrt(max(r.lo, 0.0)), math.sqrt(max(r.hi, 0.0)), r.expanded_by)
    if name == "pow":
      return _Range(-math.inf, math.inf, "pow")
    if name in _ACCUMULATING:
      n = self.reduced_size(eqn)
      if r.bounded and name in ("reduce_sum", "cumsum"):
        return _Range(min(r.lo * n, r.lo), max(r.hi * n, r.hi))
      long = n >= (self.config.long_reduction or 1024)
      if r.expanded_by or not long:
        return _Range(-math.inf, math.inf, r.expanded_by)
      growth = float(n) if name in ("reduce_sum", "cumsum") else 0.0
      return _Range(-math.inf, math.inf, f"{name} of {n} values", growth)
    if name in ("log", "log1p", "rsqrt", "dot_general", "conv_general_dilated"):
      return _UNKNOWN
    return _Range(-math.inf, math.inf, _expanded(*ranges))

  def nonpositive_argument(self, graph: _Graph, eqn: Any) -> bool:
    """Whether an exp's argument is ``x - max(x)`` (so exp is at most 1)."""
    src, _, _ = graph.back(eqn.invars[0], _TRANSPARENT)
    if src is None or src.primitive.name != "sub":
      return False
    shifts = graph.sources(src.invars[1], _TRANSPARENT | {"max"})
    return any(e.primitive.name == "reduce_max" for e in shifts)

  @staticmethod
  def reduced_size(eqn: Any) -> int:
    shape = _shape(eqn.invars[0])
    if "axes" in eqn.params:
      return math.prod(shape[a] for a in eqn.params["axes"])
    if "axis" in eqn.params and shape:
      return shape[eqn.params["axis"]]
    return math.prod(shape)

  # -- checks -------------------------------------------------------------------------------

  def check(self, eqn: Any, graph: _Graph, ranges: list[_Range], ctx: _Context, covered: set):
    name = eqn.primitive.name
    if name in ("exp", "exp2", "expm1"):
      self.check_exp(eqn, graph, ctx, covered)
    elif name in ("log", "log1p"):
      dtype = self.low(eqn.outvars[0])
      if dtype is not None:
        info = dtypes.format_info(dtype)
        self.add(
          ctx,
          "log",
          eqn,
          dtype,
          f"{name} in {dtype.name}: an input that underflowed to 0 (below "
          f"{info.min_subnormal:.1e}) gives -inf, and the result is only accurate to "
          f"~{info.epsilon:.0e} relative. Take logs in float32.",
        )
    elif name == "logistic":
      self.check_logistic(eqn, graph, ctx, covered)
    elif name in _ACCUMULATING:
      self.check_reduction(eqn, graph, ctx)
    elif name in ("square", "integer_pow", "mul"):
      self.check_square(eqn, graph, ctx)
    elif name in ("rsqrt", "sqrt"):
      self.check_norm_stats(eqn, graph, ctx)
    elif name == "div":
      self.check_division(eqn, graph, ctx)
    elif name in ("dot_general", "conv_general_dilated"):
      self.check_matmul(eqn, ctx)
      self.check_fp32_matmul(eqn, ctx)
    elif name == "convert_element_type":
      self.check_cast(eqn, graph, ranges, ctx)
    if name in ("add", "sub", "mul", "div"):
      self.check_overflowed_literal(eqn, ctx)

  def check_exp(self, eqn, graph: _Graph, ctx: _Context, covered: set):
    dtype = self.low(eqn.outvars[0])
    if dtype is None:
      return
    info = dtypes.format_info(dtype)
    numerators = graph.forward(eqn.outvars[0])
    for v in numerators:
      for red in graph.consumers.get(v, ()):
        if red.primitive.name != "reduce_sum":
          continue
        n = self.reduced_size(red)
        sums = set(graph.forward(red.outvars[0]))
        # logsumexp takes log(abs(sum)) (the sign is kept apart).
        for v in list(sums):
          sums.update(
            o
            for c in graph.consumers.get(v, ())
            if c.primitive.name == "abs"
            for o in graph.forward(c.outvars[0])
          )
        for u in numerators:
          for div in graph.consumers.get(u, ()):
            if div.primitive.name == "div" and div.invars[0] is u and div.invars[1] in sums:
              covered.update((id(div), id(red)))
              self.add(
                ctx,
                "softmax",
                eqn,
                dtype,
                f"softmax over {n} values computed in {dtype.name}: exp and the normalizing "
                f"division run in {dtype.name} ({info.mantissa_bits} mantissa bits, relative "
                f"error ~{info.epsilon:.0e}); probabilities below {info.min_subnormal:.1e} "
                "become 0 (their log is -inf) and long rows lose the small ones. Compute it "
                "in float32: jax.nn.softmax(x.astype(jnp.float32)), then cast the result.",
                size=n,
              )
              return
        for s in sums:
          for log in graph.consumers.get(s, ()):
            if log.primitive.name in ("log", "log1p"):
              covered.update((id(log), id(red)))
              self.add(
                ctx,
                "logsumexp",
                eqn,
                dtype,
                f"log-sum-exp over {n} values in {dtype.name} (log_softmax / cross-entropy): "
                f"exp and log run in {dtype.name}, so the loss is accurate to only "
                f"~{info.epsilon:.0e} relative and terms below {info.min_subnormal:.1e} "
                "vanish. Compute the loss from float32 logits (policy.cast_to_output).",
                size=n,
              )
              return
    if self.nonpositive_argument(graph, eqn):
      what = f"underflows to 0 below {math.log(info.min_subnormal):.1f}"
    else:
      what = (
        f"overflows to inf for inputs above {math.log(info.max):.1f} and underflows to 0 "
        f"below {math.log(info.min_subnormal):.1f}"
      )
    self.add(
      ctx,
      "exp",
      eqn,
      dtype,
      f"{eqn.primitive.name} in {dtype.name} {what}; its result is accurate to "
      f"~{info.epsilon:.0e} relative. Compute it in float32.",
    )

  def check_logistic(self, eqn, graph: _Graph, ctx: _Context, covered: set):
    dtype = self.low(eqn.outvars[0])
    if dtype is None:
      return
    # A sigmoid gate (SiLU, GLU) in 16 bits is fine; a sigmoid whose log is
    # taken (a binary cross-entropy written by hand) is not.
    reach = list(graph.forward(eqn.outvars[0]))
    for v in list(reach):
      for c in graph.consumers.get(v, ()):
        if c.primitive.name in ("sub", "neg"):
          reach.extend(graph.forward(c.outvars[0]))
    for v in reach:
      for log in graph.consumers.get(v, ()):
        if log.primitive.name in ("log", "log1p"):
          covered.add(id(log))
          info = dtypes.format_info(dtype)
          self.add(
            ctx,
            "logistic",
            eqn,
            dtype,
            f"log of a sigmoid computed in {dtype.name}: sigmoid(x) rounds to exactly 1 for "
            f"x > {math.log(4 / info.epsilon):.1f} and to 0 for "
            f"x < {math.log(info.min_subnormal / 2):.1f}, so log(sigmoid) or log(1 - sigmoid) "
            "is -inf. Use jax.nn.log_sigmoid or optax.sigmoid_binary_cross_entropy on float32 "
            "logits.",
          )
          return

  def check_reduction(self, eqn, graph: _Graph, ctx: _Context):
    dtype = self.low(eqn.invars[0])
    if dtype is None:
      return
    n = self.reduced_size(eqn)
    threshold = self.config._threshold(dtype, self.config.long_reduction)
    if n < threshold:
      return
    info = dtypes.format_info(dtype)
    prefix = "every prefix of " if eqn.primitive.name.startswith("cum") else ""
    self.add(
      ctx,
      "reduction",
      eqn,
      dtype,
      f"{eqn.primitive.name} over {n} values in {dtype.name}: from 1/eps = {threshold} values "
      "on, each term is smaller than the rounding error of the running sum, so a sequential "
      f"accumulation drops terms ({prefix}the result is accurate to ~{min(n * info.epsilon, 1):.2g}"
      " relative at worst); XLA may accumulate in a wider type but is not required to. "
      "Accumulate in float32: x.astype(jnp.float32).sum(...) or jnp.sum(x, dtype=jnp.float32).",
      size=n,
    )

  def check_square(self, eqn, graph: _Graph, ctx: _Context):
    name = eqn.primitive.name
    if name == "integer_pow" and eqn.params.get("y") != 2:
      return
    if name == "mul" and eqn.invars[0] is not eqn.invars[1]:
      return
    dtype = self.low(eqn.outvars[0])
    if dtype is None or not self.narrow_range(dtype):
      return
    for v in graph.forward(eqn.outvars[0]):
      for red in graph.consumers.get(v, ()):
        if red.primitive.name in ("reduce_sum", "cumsum"):
          info = dtypes.format_info(dtype)
          self.add(
            ctx,
            "normalization",
            eqn,
            dtype,
            f"x**2 in {dtype.name} feeding a sum (variance / RMS statistics) overflows to inf "
            f"for |x| > {math.sqrt(info.max):.0f}, making the statistics inf or NaN. Square "
            "and reduce in float32 (flax.linen.LayerNorm and RMSNorm compute statistics in "
            "float32 by default).",
            size=self.reduced_size(red),
          )
          return

  def check_norm_stats(self, eqn, graph: _Graph, ctx: _Context):
    dtype = self.low(eqn.invars[0])
    if dtype is None:
      return
    red, _ = self.reduction_origin(graph, eqn.invars[0])
    if red is None:
      return
    info = dtypes.format_info(dtype)
    self.add(
      ctx,
      "normalization",
      eqn,
      dtype,
      f"{eqn.primitive.name} of a reduction (normalization statistics) in {dtype.name}: "
      f"variances below {info.min_normal:.1e} are subnormal or 0 in {dtype.name}, so "
      f"1/sqrt(var + eps) loses precision or overflows (eps itself, e.g. 1e-6, is "
      f"{'subnormal' if info.min_normal > 1e-6 else 'rounded'} there), and the result carries "
      f"~{info.epsilon:.0e} relative error. Compute mean, variance and rsqrt in float32.",
      size=self.reduced_size(red),
    )

  def check_division(self, eqn, graph: _Graph, ctx: _Context):
    dtype = self.low(eqn.outvars[0])
    if dtype is None:
      return
    red, chain = self.reduction_origin(graph, eqn.invars[1])
    if red is None:
      return
    if any(e.primitive.name in ("sqrt", "rsqrt") and self.low(e.invars[0]) for e in chain):
      return  # the sqrt of the statistics is reported already
    info = dtypes.format_info(dtype)
    self.add(
      ctx,
      "division",
      eqn,
      dtype,
      f"division by a reduction (a sum, mean or norm) in {dtype.name}: a denominator that "
      f"rounded to 0 (below {info.min_subnormal:.1e}) gives inf/NaN, and the quotient carries "
      f"~{info.epsilon:.0e} relative error. Divide in float32.",
      size=self.reduced_size(red),
    )

  def check_matmul(self, eqn, ctx: _Context):
    lhs, rhs = eqn.invars[:2]
    in_dtype = self.low(lhs) or self.low(rhs)
    out_dtype = _dtype(eqn.outvars[0])
    if in_dtype is None or out_dtype is None or out_dtype not in self.formats:
      return
    n = _contraction_size(eqn)
    info = dtypes.format_info(out_dtype)
    if self.config.matmul_accumulation == "assume_fp32":
      if not dtypes.is_float8(out_dtype):
        return
      message = (
        f"{eqn.primitive.name} with a {out_dtype.name} result: the {n}-term dot products are "
        f"rounded to {out_dtype.name} ({info.mantissa_bits} mantissa bits, max {info.max:g}). "
        "Ask for a wide result with preferred_element_type=jnp.float32 (or bfloat16) and "
        "quantize with a scale afterwards."
      )
    else:
      threshold = self.config._threshold(out_dtype, self.config.long_contraction)
      if n < threshold or _states_wide_accumulation(eqn):
        return
      message = (
        f"{eqn.primitive.name} accumulating {n} products with a {out_dtype.name} result type, "
        f"the only accumulation type the program states: a backend that accumulates in "
        f"{out_dtype.name} loses terms from 1/eps = {threshold} products on. State fp32 "
        "accumulation with precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32 (F16_F16_F32), "
        "as jmp_lite.flax.dot_general does on TPU, or pass "
        "preferred_element_type=jnp.float32 and cast the result."
      )
    self.add(ctx, "matmul", eqn, out_dtype, message, size=n)

  def check_fp32_matmul(self, eqn, ctx: _Context):
    compute = self.compute_dtype
    if compute is None or ctx.backward or self.derivative_of(eqn, ctx) is not None:
      return  # the backward pass mirrors the forward one: report the forward matmul
    lhs, rhs = (_dtype(a) for a in eqn.invars[:2])
    wide = [d for d in (lhs, rhs) if d is not None and jnp.issubdtype(d, jnp.floating)]
    if len(wide) < 2 or min(d.itemsize for d in wide) < 4:
      return
    wide_name = wide[0].name
    self.add(
      ctx,
      "fp32_matmul",
      eqn,
      compute,
      f"{eqn.primitive.name} with {wide_name} operands while the compute dtype is "
      f"{compute.name}: this matmul runs in {wide_name}, at a fraction of the throughput of "
      f"{compute.name} units. A layer built with dtype=jnp.float32 (or an explicit cast to "
      "float32) keeps its dtype under a policy: build it with the default dtype=None so the "
      "policy decides. If it is meant to stay in float32 (an fp32 override, e.g. the default "
      "one of nn.Embed, whose attend() is a matmul), allow it (allow_scopes / allow_locations).",
      size=_contraction_size(eqn),
    )

  def check_cast(self, eqn, graph: _Graph, ranges: list[_Range], ctx: _Context):
    dst = self.low(eqn.outvars[0])
    src = _dtype(eqn.invars[0])
    if dst is None or src is None or not jnp.issubdtype(src, jnp.floating):
      return
    dst_info, src_info = dtypes.format_info(dst), jnp.finfo(src)
    if 2 * dst_info.max > float(src_info.max):
      return  # the same exponent range: float32 -> bfloat16 loses precision, not range
    r = ranges[0]
    overflow = "NaN" if dst.name.endswith("fn") else "inf"
    if r.bounded:  # both ends known: from constants and bounded operations
      if r.magnitude > dst_info.max:
        exact = " (a constant)" if r.lo == r.hi else ""
        self.add(
          ctx,
          "cast",
          eqn,
          dst,
          f"cast from {src.name} to {dst.name} of values reaching magnitude {r.magnitude:.3g}"
          f"{exact}, beyond {dst.name}'s max {dst_info.max:g}: they become {overflow}. A mask "
          f"value such as -1e9 must be jnp.finfo({dst.name}).min (or -inf) in 16 bits.",
        )
      return
    if r.expanded_by is not None:
      self.add(
        ctx,
        "cast",
        eqn,
        dst,
        f"cast from {src.name} to {dst.name} of the result of {r.expanded_by}, which can "
        f"exceed {dst.name}'s max {dst_info.max:g} (it would become {overflow}). Keep the "
        "value in float32, or normalize/clip it before the cast.",
      )
    elif dtypes.is_float8(dst):
      self.add(
        ctx,
        "cast",
        eqn,
        dst,
        f"cast from {src.name} to {dst.name} of values with no known bound: {dst.name} holds "
        f"magnitudes up to {dst_info.max:g} and larger ones become {overflow}. Scale the "
        f"tensor (delayed scaling) and clip it to +-{dst_info.max:g} before the cast.",
      )

  def check_overflowed_literal(self, eqn, ctx: _Context):
    for atom in eqn.invars:
      if not _jaxpr.is_literal(atom):
        continue
      dtype = self.low(atom)
      if dtype is None or not self.narrow_range(dtype):
        continue
      value = np.asarray(atom.val, np.float64)
      if np.isinf(value).any():
        self.add(
          ctx,
          "cast",
          eqn,
          dtype,
          f"{eqn.primitive.name} with the constant {float(value.flat[0])} in {dtype.name}: a "
          f"Python number beyond {dtype.name}'s max {dtypes.format_info(dtype).max:g} (e.g. "
          f"1e5) overflowed to inf when JAX converted it to {dtype.name}. Use a representable "
          "value or compute in float32.",
        )


# --------------------------------------------------------------------------------------------
# Entry points


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """make_jaxpr over the array leaves of (args, kwargs); other leaves (Python
  bools, ints, strings: flags such as ``train=False``) stay static."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  is_dynamic = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]
  dynamic = [x for x, d in zip(leaves, is_dynamic, strict=True) if d]

  def traced(*values):
    it = iter(values)
    full = [next(it) if d else x for x, d in zip(leaves, is_dynamic, strict=True)]
    a, k = jax.tree_util.tree_unflatten(treedef, full)
    return fn(*a, **k)

  return jax.make_jaxpr(traced)(*dynamic)


def _policy_of(fn: Any) -> Policy | None:
  """The :class:`Policy` a function runs under: its ``policy`` attribute (set by
  ``jmp_lite.flax.policy_apply``), looked up through ``jax.jit``,
  ``functools.wraps`` (``__wrapped__``) and ``functools.partial``."""
  for _ in range(8):
    policy = getattr(fn, "policy", None)
    if isinstance(policy, Policy):
      return policy
    fn = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
    if fn is None:
      return None
  return None


def audit_jaxpr(jaxpr: Any, audit_config: AuditConfig | None = None) -> AuditReport:
  """Audits an already traced ``ClosedJaxpr`` (e.g. from :func:`jax.make_jaxpr`)."""
  config = AuditConfig() if audit_config is None else audit_config
  if not isinstance(config, AuditConfig):
    raise TypeError(f"audit_config must be an AuditConfig, got {type(config).__name__}.")
  if isinstance(jaxpr, jex.core.ClosedJaxpr):
    inner, consts = jaxpr.jaxpr, jaxpr.consts
  elif isinstance(jaxpr, jex.core.Jaxpr):
    inner, consts = jaxpr, [None] * len(jaxpr.constvars)
  else:
    raise TypeError(f"Expected a jaxpr (ClosedJaxpr or Jaxpr), got {type(jaxpr).__name__}.")
  auditor = _Auditor(config)
  auditor.visit(inner, consts, [_UNKNOWN] * len(inner.invars), _Context("", False, None, None))
  return AuditReport(tuple(auditor.findings), auditor.num_operations, tuple(config.formats))


def audit(
  fn: Callable[..., Any],
  *args: Any,
  audit_config: AuditConfig | None = None,
  **kwargs: Any,
) -> AuditReport:
  """Finds the precision-sensitive operations ``fn(*args, **kwargs)`` runs in 16 or 8 bits.

  ``fn`` is traced, not run: arguments may be arrays or
  :class:`jax.ShapeDtypeStruct`; other leaves (Python bools, ints, strings,
  e.g. ``train=False``) are passed as static values. Typical uses::

    # the forward pass under a policy
    print(jl.audit(lambda p, x: model.apply(policy.cast_to_compute(p), x), params, x))
    # a whole train step, in a test: fails on a regression
    assert not jl.audit(train_step, params, opt_state, batch)

  Args:
    fn: any function of arrays (a jitted function is fine).
    *args: its positional arguments.
    audit_config: an :class:`AuditConfig` with checks, thresholds and
      allow-lists (default: everything on, default thresholds). Without a
      ``compute_dtype``, the compute dtype of ``fn.policy`` (a
      :class:`~jmp_lite.Policy`, looked up through ``jax.jit`` and
      ``functools.partial``) is used when there is one.
    **kwargs: its keyword arguments.

  Returns:
    An :class:`AuditReport`: ``str(report)`` is a readable report grouped by
    source line, ``report.findings`` the structured :class:`Finding` list.
  """
  if not callable(fn):
    raise TypeError(f"audit expects a callable as its first argument, got {fn!r}.")
  config = AuditConfig() if audit_config is None else audit_config
  if isinstance(config, AuditConfig) and config.compute_dtype is None:
    policy = _policy_of(fn)
    if policy is not None:  # a policy-wrapped function: its matmuls should run in 16 bits
      config = dataclasses.replace(config, compute_dtype=policy.compute_dtype)
  return audit_jaxpr(_trace(fn, args, kwargs), config)
