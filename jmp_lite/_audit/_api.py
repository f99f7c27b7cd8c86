"""The entry points: :func:`audit` traces a function, :func:`audit_jaxpr` audits a jaxpr."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jmp_lite import _jaxpr, _tree_util
from jmp_lite._audit import _walk
from jmp_lite._audit._config import AuditConfig
from jmp_lite._audit._report import AuditReport
from jmp_lite._policy import Policy


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """make_jaxpr over the array leaves of (args, kwargs); other leaves (Python
  bools, ints, strings: flags such as ``train=False``) stay static."""
  arrays, rebuild = _tree_util.split_leaves(
    (args, kwargs), lambda x: _tree_util.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
  )

  def traced(*values):
    a, k = rebuild(list(values))
    return fn(*a, **k)

  return jax.make_jaxpr(traced)(*arrays)


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
  """Audits an already traced jaxpr (e.g. from :func:`jax.make_jaxpr`).

  >>> closed = jax.make_jaxpr(jnp.exp)(jnp.ones(4, jnp.float16))
  >>> [f.check for f in jl.audit_jaxpr(closed)]
  ['exp']

  Args:
    jaxpr: a ``ClosedJaxpr``, or an open ``Jaxpr`` (its constants are then unknown).
    audit_config: an :class:`AuditConfig` (default: everything on, default
      thresholds). Unlike :func:`audit`, no ``policy`` is looked up: set
      ``compute_dtype`` for the ``fp32_matmul`` check.

  Returns:
    An :class:`AuditReport` of the jaxpr's equations and those of its nested jaxprs.
  """
  config = AuditConfig() if audit_config is None else audit_config
  if not isinstance(config, AuditConfig):
    raise TypeError(f"audit_config must be an AuditConfig, got {type(config).__name__}.")
  core = _jaxpr.extend_core()
  if isinstance(jaxpr, core.ClosedJaxpr):
    inner, consts = jaxpr.jaxpr, jaxpr.consts
  elif isinstance(jaxpr, core.Jaxpr):
    inner, consts = jaxpr, [None] * len(jaxpr.constvars)
  else:
    raise TypeError(f"Expected a jaxpr (ClosedJaxpr or Jaxpr), got {type(jaxpr).__name__}.")
  findings, num_operations = _walk.walk(inner, consts, config)
  return AuditReport(tuple(findings), num_operations, tuple(config.formats))


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

  >>> x = jnp.ones((2, 8), jnp.float16)
  >>> [f.check for f in jl.audit(jax.nn.softmax, x)]
  ['softmax']
  >>> jl.audit(lambda x: jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype), x).ok
  True

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
