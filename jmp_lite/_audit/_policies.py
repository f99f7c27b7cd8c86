"""The policies an audit judges a program by, and where each one comes from.

A matmul should run in the compute dtype of the policy in force where it was
traced. The audit knows four sources, in this order:

1. :attr:`AuditConfig.compute_dtype`, when given: the whole program is judged by it.
2. The policy scope around the equation (:mod:`jmp_lite._policy_scope`): the
   model that ``jmp_lite.flax.policy_apply`` / ``policy_view`` runs, found in
   a jaxpr of a whole training step too.
3. The ``policy`` attribute of the audited function (``policy_apply``'s).
4. The policies among the audited function's arguments (:func:`policies_in`):
   a :class:`~jmp_lite.Policy` argument, or one held in a field of a state
   (``jmp_lite.flax.TrainState.policy``, a static field). Outside every
   policy scope a float32 matmul then means that the step ran the model
   without its policy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite._policy import Policy
from jmp_lite._policy_scope import innermost_policy

# Bounds the walk over arguments (a large model's parameters have thousands of leaves).
_MAX_NODES = 100_000


class ComputePolicy(NamedTuple):
  """The compute dtype an equation is judged by, and where it comes from."""

  dtype: np.dtype  # an audited 16/8-bit dtype
  # "config" (AuditConfig.compute_dtype), "scope" (a policy scope around the
  # equation), "function" (the audited function's policy) or "arguments".
  source: str
  policy: Policy | None  # the policy it is the compute dtype of (None for "config")


def function_policy(fn: Any) -> Policy | None:
  """The :class:`Policy` a function runs under: its ``policy`` attribute.

  Set by ``jmp_lite.flax.policy_apply``; looked up through ``jax.jit``,
  ``functools.wraps`` (``__wrapped__``) and ``functools.partial``.

  Args:
    fn: the audited function.

  Returns:
    The policy, or None.
  """
  for _ in range(8):
    policy = getattr(fn, "policy", None)
    if isinstance(policy, Policy):
      return policy
    fn = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
    if fn is None:
      return None
  return None


def _children(node: Any) -> list[Any]:
  """What a node of the arguments holds: items, dataclass fields (static ones too), children."""
  if isinstance(node, (list, tuple)):
    return list(node)
  if isinstance(node, Mapping):
    return list(node.values())
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    # Every field, pytree leaves and static fields alike: a TrainState keeps its policy
    # in a static field, which flattening the state would drop.
    return [getattr(node, f.name, None) for f in dataclasses.fields(node)]
  children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
  return [] if treedef.num_nodes == 1 else children


def policies_in(tree: Any) -> tuple[Policy, ...]:
  """The policies among an audited function's arguments, in argument order.

  A :class:`~jmp_lite.Policy` is found where the arguments hold one: as an
  argument or a pytree leaf, in a list, tuple or mapping, or in a field of a
  dataclass, static pytree fields included (``jmp_lite.flax.TrainState``
  keeps its ``policy`` there; Equinox modules are dataclasses too), and as
  the policy of a function found there (:func:`function_policy`: a state's
  ``apply_fn`` from ``policy_apply``). Other objects are not looked into.

  Args:
    tree: the arguments, e.g. ``(args, kwargs)``.

  Returns:
    The distinct policies found, first seen first.
  """
  found: dict[Policy, None] = {}
  todo, seen = [tree], set()
  while todo and len(seen) < _MAX_NODES:
    node = todo.pop()
    if node is None or id(node) in seen or isinstance(node, (jax.Array, np.ndarray)):
      continue
    seen.add(id(node))
    if isinstance(node, Policy):
      found.setdefault(node)
      continue
    if callable(node) and not isinstance(node, type) and not dataclasses.is_dataclass(node):
      policy = function_policy(node)
      if policy is not None:
        found.setdefault(policy)
      continue
    todo.extend(reversed(_children(node)))
  return tuple(found)


def marks_policy(jaxpr: Any) -> bool:
  """Whether any equation of ``jaxpr`` or of its nested jaxprs runs in a policy scope.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr``.

  Returns:
    True when some name stack holds a policy scope's mark.
  """
  todo = [jaxpr]
  while todo:
    for eqn in todo.pop().eqns:
      info = eqn.source_info
      if info is not None and innermost_policy(str(info.name_stack)) is not None:
        return True
      todo.extend(sub.jaxpr for sub in _jaxpr.sub_jaxprs(eqn))
  return False
