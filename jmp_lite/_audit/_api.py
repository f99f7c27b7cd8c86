"""The entry points: :func:`audit` traces a function, :func:`audit_jaxpr` audits a jaxpr."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jmp_lite import _compat, _tree_util
from jmp_lite._audit import _policies, _walk
from jmp_lite._audit._config import AuditConfig
from jmp_lite._audit._report import AuditReport
from jmp_lite._policy import Policy


def _traceable(x: Any) -> bool:
  return _tree_util.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """make_jaxpr over the array leaves of (args, kwargs) and of the result.

  The other leaves of the arguments (Python bools, ints, strings: flags such
  as ``train=False``; the functions an Equinox module holds) stay static, as
  ``eqx.filter_jit`` keeps them; those of the result (an Equinox module's
  activation function) are dropped, since only arrays are traced.
  """
  arrays, rebuild = _tree_util.split_leaves((args, kwargs), _traceable)

  def traced(*values):
    a, k = rebuild(list(values))
    return [x for x in jax.tree_util.tree_leaves(fn(*a, **k)) if isinstance(x, jax.Array)]

  return jax.make_jaxpr(traced)(*arrays)


def _audit(
  closed: Any,
  config: Any,
  function_policy: Policy | None = None,
  argument_policies: tuple[Policy, ...] = (),
) -> AuditReport:
  if not isinstance(config, AuditConfig):
    raise TypeError(f"audit_config must be an AuditConfig, got {type(config).__name__}.")
  core = _compat.extend_core()
  if isinstance(closed, core.ClosedJaxpr):
    inner, consts = closed.jaxpr, closed.consts
  elif isinstance(closed, core.Jaxpr):
    inner, consts = closed, [None] * len(closed.constvars)
  else:
    raise TypeError(f"Expected a jaxpr (ClosedJaxpr or Jaxpr), got {type(closed).__name__}.")
  findings, num_operations = _walk.walk(inner, consts, config, function_policy, argument_policies)
  return AuditReport(tuple(findings), num_operations, tuple(config.formats))


def audit_jaxpr(jaxpr: Any, audit_config: AuditConfig | None = None) -> AuditReport:
  """Audits an already traced jaxpr (e.g. from :func:`jax.make_jaxpr`).

  >>> closed = jax.make_jaxpr(jnp.exp)(jnp.ones(4, jnp.float16))
  >>> [f.check for f in jl.audit_jaxpr(closed)]
  ['exp']

  Args:
    jaxpr: a ``ClosedJaxpr``, or an open ``Jaxpr`` (its constants are then unknown).
    audit_config: an :class:`AuditConfig` (default: everything on, default
      thresholds). The ``fp32_matmul`` check judges the equations in a
      policy scope (``jmp_lite.flax.policy_apply``'s) by their policy; unlike
      :func:`audit`, no function or arguments are there to take a policy
      from for the others: set ``compute_dtype`` for them.

  Returns:
    An :class:`AuditReport` of the jaxpr's equations and those of its nested jaxprs.
  """
  return _audit(jaxpr, AuditConfig() if audit_config is None else audit_config)


def audit(
  fn: Callable[..., Any],
  *args: Any,
  audit_config: AuditConfig | None = None,
  **kwargs: Any,
) -> AuditReport:
  """Finds the precision-sensitive operations ``fn(*args, **kwargs)`` runs in 16 or 8 bits.

  ``fn`` is traced, not run: arguments may be arrays or
  :class:`jax.ShapeDtypeStruct`; other leaves (Python bools, ints, strings,
  e.g. ``train=False``, the functions an Equinox module holds) are passed as
  static values, and results may hold anything (only their arrays are
  traced). Typical uses::

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
      ``compute_dtype``, each matmul is judged by the policy it runs under
      (``jmp_lite.flax.policy_apply`` / ``policy_view`` mark it in the
      trace), else by ``fn.policy`` (a :class:`~jmp_lite.Policy`, looked up
      through ``jax.jit`` and ``functools.partial``), else by the first
      ``Policy`` among the arguments (a ``jmp_lite.flax.TrainState``'s
      ``policy`` field included); in a step that differentiates, these two
      judge only what ``jax.grad`` differentiates, not the optimizer's update.
    **kwargs: its keyword arguments.

  Returns:
    An :class:`AuditReport`: ``str(report)`` is a readable report grouped by
    source line, ``report.findings`` the structured :class:`Finding` list.
  """
  if not callable(fn):
    raise TypeError(f"audit expects a callable as its first argument, got {fn!r}.")
  config = AuditConfig() if audit_config is None else audit_config
  if not isinstance(config, AuditConfig):
    raise TypeError(f"audit_config must be an AuditConfig, got {type(config).__name__}.")
  policies = _policies.policies_in((args, kwargs))
  return _audit(_trace(fn, args, kwargs), config, _policies.function_policy(fn), policies)
