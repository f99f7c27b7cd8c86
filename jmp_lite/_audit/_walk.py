"""The walk: every equation of a jaxpr and of its nested jaxprs, in program order.

For each equation the walk computes its origin (scope, source line, forward or
backward pass) and its operands' value ranges, runs the registered checks of
its primitive, turns what they report into findings (applying the
configuration), and propagates ranges to its results: through a nested jaxpr
when the equation has one (``jit``, ``scan``, ``cond``...), by the primitive's
transfer function otherwise. It knows no check by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite._audit import _config, _policies, _ranges, _registry, _source
from jmp_lite._audit._graph import GraphCache
from jmp_lite._audit._ranges import UNKNOWN, Range
from jmp_lite._audit._report import Finding
from jmp_lite._policy import Policy


def _context(
  config: _config.AuditConfig,
  jaxpr: Any,
  function_policy: Policy | None,
  argument_policies: tuple[Policy, ...],
) -> _registry.AuditContext:
  formats = frozenset(np.dtype(jnp.dtype(f)) for f in config.formats)
  # The dtype matmuls should run in (fp32_matmul), if configured.
  compute = None if config.compute_dtype is None else np.dtype(jnp.dtype(config.compute_dtype))
  return _registry.AuditContext(
    formats=formats,
    compute_dtype=compute,
    function_policy=function_policy,
    argument_policies=argument_policies,
    marked=_policies.marks_policy(jaxpr),
    long_reduction=config.long_reduction,
    long_contraction=config.long_contraction,
    matmul_accumulation=config.matmul_accumulation,
    graphs=GraphCache(),
    frames=_source.FrameFilter(config.library_paths),
  )


class _Walker:
  """Walks one audit's jaxprs and collects its findings."""

  def __init__(self, config: _config.AuditConfig, audit: _registry.AuditContext):
    self.config = config
    self.audit = audit
    self.findings: list[Finding] = []
    self.num_operations = 0

  def visit(
    self, jaxpr: Any, consts: Sequence[Any], in_ranges: Sequence[Range], origin: _source.Origin
  ) -> list[Range]:
    """Checks the equations of ``jaxpr``; returns the ranges of its outputs."""
    graph = self.audit.graphs(jaxpr)
    env: dict[Any, Range] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=False):
      env[v] = _ranges.range_of_value(c)
    for v, r in zip(jaxpr.invars, in_ranges, strict=False):
      env[v] = r

    def rng(atom: Any) -> Range:
      if _jaxpr.is_literal(atom):
        return _ranges.range_of_value(atom.val)
      return env.get(atom, UNKNOWN)

    covered: set[int] = set()  # equations a finding accounts for already
    for eqn in jaxpr.eqns:
      self.num_operations += 1
      here = _source.origin_of(origin, eqn, self.audit.frames)
      ranges = [rng(a) for a in eqn.invars]
      if id(eqn) not in covered:
        self._check(_registry.Site(eqn, graph, ranges, here, self.audit), covered)
      outs = self._visit_nested(eqn, rng, here)
      if outs is None:
        outs = [_ranges.transfer(eqn, graph, ranges)] * len(eqn.outvars)
      for v, r in zip(eqn.outvars, outs, strict=False):
        env[v] = r
    return [rng(v) for v in jaxpr.outvars]

  def _visit_nested(self, eqn: Any, rng: Any, origin: _source.Origin) -> list[Range] | None:
    """Visits the sub-jaxprs of ``eqn``; the ranges of its results when they tell them."""
    outs = None
    branches = []
    for sub in _jaxpr.sub_jaxprs(eqn):
      inner_in = [UNKNOWN if b is None else rng(b) for b in sub.bindings]
      inner_out = self.visit(sub.jaxpr, sub.consts, inner_in, origin)
      if sub.returns_outputs:
        outs = inner_out
      elif eqn.primitive.name == "cond" and len(inner_out) == len(eqn.outvars):
        branches.append(inner_out)
    if outs is None and branches:  # cond: the result is one of its branches' results
      outs = [_ranges.union(*rs) for rs in zip(*branches, strict=True)]
    return outs

  def _check(self, site: _registry.Site, covered: set[int]) -> None:
    # Every check of the primitive runs, enabled or not: a disabled softmax
    # check still covers its division, which is no division by a norm.
    for check in _registry.checks_for(site.eqn.primitive.name):
      hit = check.run(site)
      if hit is None:
        continue
      covered.update(id(e) for e in hit.covers)
      finding = self._finding(check.name, site, hit)
      if finding is not None:
        self.findings.append(finding)

  def _finding(self, check: str, site: _registry.Site, hit: _registry.Hit) -> Finding | None:
    """The finding ``hit`` makes, or None when the configuration drops it."""
    config, origin, eqn = self.config, site.origin, site.eqn
    if check not in config.checks or (origin.backward and not config.include_backward):
      return None
    derivative_of = site.derivative_of()
    message = hit.message
    if derivative_of:
      message += (
        f" JAX's autodiff created this operation for the derivative of {derivative_of}: "
        f"computing {derivative_of} in float32 moves its derivative to float32 too."
      )
    finding = Finding(
      check=check,
      primitive=eqn.primitive.name,
      dtype=hit.dtype.name,
      operands=tuple(_jaxpr.aval_str(a) for a in eqn.invars),
      results=tuple(_jaxpr.aval_str(a) for a in eqn.outvars),
      message=message,
      location=origin.location,
      library_location=origin.library_location,
      scope=origin.scope,
      backward=origin.backward,
      size=None if hit.size is None else int(hit.size),
      autodiff=derivative_of is not None,
      derivative_of=derivative_of,
    )
    return None if _config.allowed(config, finding) else finding


def walk(
  jaxpr: Any,
  consts: Sequence[Any],
  config: _config.AuditConfig,
  function_policy: Policy | None = None,
  argument_policies: tuple[Policy, ...] = (),
) -> tuple[list, int]:
  """Audits a jaxpr and its nested jaxprs.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr``.
    consts: the values of its constvars (None where unknown).
    config: the configuration.
    function_policy: the audited function's policy, or None.
    argument_policies: the policies among the audited function's arguments.

  Returns:
    ``(findings, number of equations checked)``.
  """
  walker = _Walker(config, _context(config, jaxpr, function_policy, argument_policies))
  walker.visit(jaxpr, consts, [UNKNOWN] * len(jaxpr.invars), _source.TOP)
  return walker.findings, walker.num_operations
