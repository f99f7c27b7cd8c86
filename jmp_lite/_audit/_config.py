r"""The audit's configuration: formats, checks, thresholds and allow-lists."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite._audit._checks import AUDIT_CHECKS
from jmp_lite._audit._report import Finding

DEFAULT_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
MATMUL_MODES = ("assume_fp32", "as_written")


def _str_tuple(value: Any, name: str) -> tuple[str, ...]:
  if isinstance(value, str) or not isinstance(value, Collection):
    raise TypeError(f"{name} must be a collection of strings, got {value!r}.")
  for item in value:
    if not isinstance(item, str):
      raise TypeError(f"{name} must contain strings, got {item!r} in {value!r}.")
  return tuple(value)


def _formats(value: Any) -> tuple[str, ...]:
  if isinstance(value, (str, np.dtype)) or not isinstance(value, Collection):
    raise TypeError(f"formats must be a sequence of dtype names, got {value!r}.")
  names = []
  for item in value:
    dtype = dtypes.parse_dtype(item)
    if dtype.itemsize >= 4:
      raise ValueError(
        f"formats lists the low-precision formats to audit; {dtype.name} (from {item!r}) is "
        "not narrower than 32 bits."
      )
    names.append(dtype.name)
  return tuple(dict.fromkeys(names))


def _checks(value: Any) -> frozenset[str]:
  checks = _str_tuple(value, "checks")
  unknown = sorted(set(checks) - set(AUDIT_CHECKS))
  if unknown:
    raise ValueError(f"Unknown checks {unknown}; known checks: {', '.join(AUDIT_CHECKS)}.")
  return frozenset(checks)


@dataclasses.dataclass(frozen=True)
class AuditConfig:
  r"""What :func:`~jmp_lite.audit` checks, its thresholds and allow-lists.

  Attributes:
    formats: the low-precision formats to audit (names or dtypes, each
      narrower than 32 bits). Default: float16, bfloat16 and both fp8 formats.
    checks: the checks to run, names from :data:`~jmp_lite.AUDIT_CHECKS` (default: all).
    long_reduction: the length from which a reduction is *long*: a sum,
      product or cumulative sum of at least this many values in a
      low-precision format is reported (check ``reduction``). Default (None):
      per format, :math:`1/\epsilon` (128 for bfloat16, 1024 for float16, 8
      for e4m3), from which on a sequential accumulation drops terms. It
      governs the ``reduction`` check only.
    long_contraction: with ``matmul_accumulation="as_written"``, a matmul is
      reported from this contraction length on (default: per format,
      :math:`1/\epsilon`).
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
    compute_dtype: the dtype the whole program is meant to compute in (a name
      or dtype), for the ``fp32_matmul`` check: with a 16/8-bit compute dtype,
      forward-pass matmuls with a float32 operand are reported. Default (None):
      per matmul, the compute dtype of the policy it runs under (the policy
      scope of ``jmp_lite.flax.policy_apply`` / ``policy_view`` around it),
      else of the audited function's ``policy`` attribute, else of the first
      :class:`~jmp_lite.Policy` among its arguments (a
      ``jmp_lite.flax.TrainState``'s ``policy``); no ``fp32_matmul`` check
      where there is none.

  Raises:
    TypeError, ValueError: naming the field and the value it was given.
  """

  formats: Sequence[Any] = DEFAULT_FORMATS
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
    set_("formats", _formats(self.formats))
    set_("checks", _checks(self.checks))
    for name in ("long_reduction", "long_contraction"):
      set_(name, _validation.check_int(getattr(self, name), name, 1, optional=True))
    set_(
      "matmul_accumulation",
      _validation.check_choice(
        self.matmul_accumulation, "matmul_accumulation", MATMUL_MODES, type_error=False
      ),
    )
    set_("include_backward", _validation.check_bool(self.include_backward, "include_backward"))
    for name in ("allow_primitives", "allow_locations", "allow_scopes", "library_paths"):
      set_(name, _str_tuple(getattr(self, name), name))
    if self.allow is not None and not callable(self.allow):
      raise TypeError(f"allow must be a callable taking a Finding, got {self.allow!r}.")
    if self.compute_dtype is not None:
      try:
        set_("compute_dtype", dtypes.parse_dtype(self.compute_dtype).name)
      except (TypeError, ValueError) as e:
        raise type(e)(f"compute_dtype={self.compute_dtype!r}: {e}") from e


def allowed(config: AuditConfig, finding: Finding) -> bool:
  """Whether ``config``'s allow-lists drop ``finding``.

  Args:
    config: the configuration.
    finding: a finding of an enabled check.

  Returns:
    True when its primitive, a location, its scope or the ``allow`` predicate allows it.
  """
  if finding.primitive in config.allow_primitives:
    return True
  for loc in (finding.location, finding.library_location):
    if loc is not None:
      base = os.path.basename(loc.file)
      keys = (f"{loc.file}:{loc.line}", loc.file, f"{base}:{loc.line}", base)
      if any(fnmatch.fnmatch(k, p) for k in keys for p in config.allow_locations):
        return True
  if any(fnmatch.fnmatch(finding.scope, p) for p in config.allow_scopes):
    return True
  return bool(config.allow is not None and config.allow(finding))
