"""The contract of a check, and the registry the walk dispatches through.

A check is one function, registered with its name, a one-line description and
the primitives it looks at::

  @register("log", "log, log1p in 16/8 bits", primitives={"log", "log1p"})
  def log(site: Site) -> Hit | None:
    dtype = site.audit.low(site.eqn.outvars[0])
    return None if dtype is None else Hit(dtype, "...")

The walk calls it on every equation of those primitives (nested jaxprs
included) and turns the :class:`Hit` it returns into a
:class:`~jmp_lite.Finding`, applying the configuration: enabled checks,
backward pass, allow-lists. The walk knows no check by name;
:data:`~jmp_lite.AUDIT_CHECKS` lists the registered ones, in registration order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _jaxpr
from jmp_lite._audit import _source
from jmp_lite._audit._graph import Graph, GraphCache
from jmp_lite._audit._policies import ComputePolicy
from jmp_lite._audit._ranges import Range
from jmp_lite._policy import Policy


@dataclasses.dataclass(frozen=True, eq=False)
class AuditContext:
  """What every check may consult, fixed for one audit: formats, thresholds, caches.

  Attributes:
    formats: the audited low-precision dtypes.
    compute_dtype: :attr:`AuditConfig.compute_dtype` (when given, the only one that counts).
    function_policy: the audited function's ``policy`` attribute, or None.
    argument_policies: the policies among the audited function's arguments.
    marked: whether the program runs anything in a policy scope.
    long_reduction: the ``reduction`` check's length threshold, or None for 1/eps.
    long_contraction: the ``matmul`` check's threshold (``"as_written"``), or None.
    matmul_accumulation: ``"assume_fp32"`` or ``"as_written"``.
    graphs: one :class:`~jmp_lite._audit._graph.Graph` per jaxpr.
    frames: classifies source files, to tell which operations autodiff created.
  """

  formats: frozenset[np.dtype]
  compute_dtype: np.dtype | None
  function_policy: Policy | None
  argument_policies: tuple[Policy, ...]
  marked: bool
  long_reduction: int | None
  long_contraction: int | None
  matmul_accumulation: str
  graphs: GraphCache
  frames: _source.FrameFilter

  def low(self, atom: Any) -> np.dtype | None:
    """The dtype of a jaxpr atom if it is an audited format, else None."""
    dtype = _jaxpr.dtype_of(atom)
    return dtype if dtype in self.formats else None

  def compute_at(self, origin: _source.Origin) -> ComputePolicy | None:
    """The compute dtype an equation is judged by (see :mod:`jmp_lite._audit._policies`).

    Args:
      origin: the equation's origin (its policy scope).

    Returns:
      The configured compute dtype, else that of the policy scope around the
      equation, of the audited function's policy, or of the first policy
      among the arguments; None when there is none or it is not an audited
      16/8-bit format.
    """
    if self.compute_dtype is not None:
      audited = self.compute_dtype in self.formats
      return ComputePolicy(self.compute_dtype, "config", None) if audited else None
    for source, policy in (
      ("scope", origin.policy),
      ("function", self.function_policy),
      ("arguments", self.argument_policies[0] if self.argument_policies else None),
    ):
      if policy is not None:
        dtype = np.dtype(policy.compute_dtype)
        return ComputePolicy(dtype, source, policy) if dtype in self.formats else None
    return None

  def reduction_threshold(self, dtype: np.dtype) -> int:
    r"""The length of a long reduction in ``dtype``: ``long_reduction``, or :math:`1/\epsilon`."""
    return _one_over_epsilon(dtype) if self.long_reduction is None else self.long_reduction

  def contraction_threshold(self, dtype: np.dtype) -> int:
    r"""The length of a long contraction: ``long_contraction``, or :math:`1/\epsilon`."""
    return _one_over_epsilon(dtype) if self.long_contraction is None else self.long_contraction


def _one_over_epsilon(dtype: np.dtype) -> int:
  return round(1 / dtypes.format_info(dtype).epsilon)


def narrow_range(dtype: np.dtype) -> bool:
  """Whether ``dtype``'s range is narrower than float32's (float16, fp8; not bfloat16)."""
  return dtypes.format_info(dtype).max < 1e38


class Site(NamedTuple):
  """One equation, as a check sees it."""

  eqn: Any  # the equation
  graph: Graph  # producers and consumers of the jaxpr that holds it
  ranges: Sequence[Range]  # its operands' value ranges
  origin: _source.Origin  # its scope, source line, forward or backward pass
  audit: AuditContext

  def derivative_of(self) -> str | None:
    """None when the user's code wrote the equation; else the operation whose
    derivative autodiff created it for (``""`` when unknown)."""
    return _source.derivative_of(self.eqn, self.origin, self.audit.frames)


class Hit(NamedTuple):
  """What a check reports about one equation; the walk makes it a Finding."""

  dtype: np.dtype  # the low-precision dtype involved
  message: str  # what goes wrong and how to fix it
  size: int | None = None  # values reduced / contracted / normalized
  # Other equations of the same jaxpr this finding accounts for (a softmax's
  # sum and division): no check looks at them again.
  covers: tuple[Any, ...] = ()


class CheckFn(Protocol):
  """The function of a check."""

  def __call__(self, site: Site) -> Hit | None:
    """Looks at one equation of a registered primitive.

    Args:
      site: the equation, its graph, its operands' ranges and origin, and the audit's settings.

    Returns:
      A :class:`Hit` to report, or None.
    """


class Check(NamedTuple):
  """A registered check."""

  name: str  # the Finding.check it reports, a key of AUDIT_CHECKS
  description: str  # one line: what it reports
  primitives: frozenset[str]  # the primitives whose equations it is called on
  run: CheckFn


_REGISTRY: dict[str, Check] = {}
_BY_PRIMITIVE: dict[str, tuple[Check, ...]] = {}


def register(
  name: str, description: str, primitives: Collection[str]
) -> Callable[[CheckFn], CheckFn]:
  """Registers a check function (a decorator).

  Args:
    name: the check's name, unique.
    description: one line saying what it reports.
    primitives: the primitives it looks at.

  Returns:
    A decorator that registers a :class:`CheckFn` and returns it unchanged.
  """

  def decorator(fn: CheckFn) -> CheckFn:
    if name in _REGISTRY:
      raise ValueError(f"A check named {name!r} is registered already.")
    check = Check(name, description, frozenset(primitives), fn)
    _REGISTRY[name] = check
    for primitive in check.primitives:
      _BY_PRIMITIVE[primitive] = (*_BY_PRIMITIVE.get(primitive, ()), check)
    return fn

  return decorator


def registered() -> tuple[Check, ...]:
  """The registered checks, in registration order."""
  return tuple(_REGISTRY.values())


def checks_for(primitive: str) -> tuple[Check, ...]:
  """The checks that look at ``primitive``, in registration order."""
  return _BY_PRIMITIVE.get(primitive, ())
