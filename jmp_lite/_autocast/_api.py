"""``autocast`` and ``full_precision``: a precision policy applied op by op to any function."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._autocast import _modules, _table
from jmp_lite._autocast._interpret import FULL_PRECISION_SCOPE, Config, Value
from jmp_lite._autocast._program import evaluate
from jmp_lite._policy import Policy, cast_floating, get_policy

F = TypeVar("F", bound=Callable[..., Any])
_F32 = np.dtype(np.float32)


def _as_policy(policy: Any) -> Policy:
  if isinstance(policy, Policy):
    return policy
  if isinstance(policy, str):
    return get_policy(policy)
  raise TypeError(f"policy must be a jmp_lite.Policy or a policy string, got {policy!r}.")


def _pattern(pattern: Any) -> re.Pattern:
  try:
    return re.compile(pattern)
  except (re.error, TypeError) as e:
    raise ValueError(f"scopes: {pattern!r} is not a regular expression ({e}).") from None


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_float(x: Any) -> bool:
  return _is_array(x) and bool(jnp.issubdtype(x.dtype, jnp.floating))


def autocast(
  fun: F,
  policy: Policy | str,
  *,
  table: Mapping[str, str] | None = None,
  overrides: Mapping[str, str] | None = None,
  scopes: Mapping[str, Any] | None = None,
  modules: Mapping[type, Any] | None = None,
) -> F:
  """``fun`` with ``policy`` applied op by op (a rewrite of its traced program).

  ``fun`` is traced with its floating array arguments cast to the compute
  dtype, then its program is evaluated equation by equation under the op table
  (:data:`jmp_lite.AUTOCAST_TABLE`, docs/autocast.md): matmuls and convolutions
  on compute-dtype operands, ``exp``/``log``/long reductions... in fp32 (from
  the unrounded fp32 argument where one was given), the rest at the dtypes the
  program gives them, casts as written. Floating outputs are cast to the
  output dtype; other leaves pass through. Gradients with respect to an
  argument have its dtype (fp32 for fp32 parameters).

  Args:
    fun: the function; its arguments and results are pytrees of arrays (other
      leaves are treated as constants).
    policy: a :class:`~jmp_lite.Policy` or a policy string
      (:func:`~jmp_lite.get_policy`). Its param dtype is not applied:
      parameters arrive in the dtype they are stored in.
    table: an op table replacing the default (primitive name -> ``"compute"``,
      ``"float32"``, ``"input"`` or ``"cast"``).
    overrides: rules for some primitives, applied on top of ``table``.
    scopes: name-scope regular expressions -> dtype: operations whose name
      stack matches run in that dtype (the first pattern that matches wins).
    modules: classes of callable pytree nodes (Equinox modules) -> dtype: the
      calls of their instances found in the arguments (or ``fun`` itself) run
      in that dtype; a nested instance's own class wins over its parent's, a
      ``scopes`` pattern over both. A class with no instance there warns.

  Returns:
    A function with ``fun``'s signature.

  Raises:
    TypeError: for a policy that is neither a Policy nor a string, a table
      that is not a mapping, or a ``modules`` key that is not a class.
    ValueError: for a bad policy string, rule, scope pattern or dtype name.
  """
  policy = _as_policy(policy)
  rules = _table.check_table(_table.AUTOCAST_TABLE if table is None else table, "table")
  rules.update(_table.check_table({} if overrides is None else overrides, "overrides"))
  scope_rules = _modules.dtype_rules(scopes, "scopes", "name-scope patterns", _pattern)
  config = Config(np.dtype(policy.compute_dtype), rules, scope_rules)
  output = np.dtype(policy.output_dtype)
  module_rules = _modules.check_modules(modules)

  @functools.wraps(fun)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    # Named module instances become scoped views for the trace; the caller's arguments (and
    # so their gradients) keep their own classes. A ``fun`` that is a pytree (an Equinox
    # module) has its array leaves cast as arguments are.
    called, found = _modules.scope_instances((fun, args, kwargs), module_rules)
    _modules.check_found(module_rules, found)
    call = lambda tree: _modules.unscope(tree[0](*tree[1], **tree[2]))
    outs, rebuild = evaluate(call, called, config, lambda x: cast_floating(x, config.compute))
    return rebuild([_output(v, output) for v in outs])

  return wrapped  # type: ignore[return-value]


def _output(value: Value, dtype: np.dtype) -> Any:
  x = value.narrow
  if not _is_float(x):  # integer, boolean and key outputs (and literals) pass through
    return x
  if value.wide is not None and dtype == _F32:
    return value.wide
  return x.astype(dtype) if x.dtype != dtype else x


def full_precision(fn: F) -> F:
  """``fn`` run in fp32, its floating outputs returned in the dtype it was given.

  The floating array arguments are cast to fp32 and the floating outputs to the
  promoted dtype of those arguments (fp32 when there are none). Inside
  :func:`autocast`, the op table leaves ``fn``'s operations in fp32 (they run
  under a named scope that marks them).

  Args:
    fn: the function.

  Returns:
    A function with ``fn``'s signature.
  """

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    floats = [x.dtype for x in jax.tree_util.tree_leaves((args, kwargs)) if _is_float(x)]
    given = jnp.result_type(*floats) if floats else _F32
    with jax.named_scope(FULL_PRECISION_SCOPE):
      out = fn(*cast_floating(args, _F32), **cast_floating(kwargs, _F32))
      return cast_floating(out, given)

  return wrapped  # type: ignore[return-value]
