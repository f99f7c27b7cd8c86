r"""Where a precision policy runs, marked in the jaxpr: a named scope naming the policy (private).

The functions that run a model under a policy (``jmp_lite.flax.policy_apply``,
``jmp_lite.flax.policy_view``) trace it inside :func:`policy_scope`, a
:func:`jax.named_scope` called, for ``"params=float32,compute=bfloat16,output=float32"``::

  jmp_lite.policy[params=float32,compute=bfloat16,output=float32]

JAX records the name stack on every equation traced inside it and keeps it
through ``jit``, ``grad`` (``jvp(...)``, ``transpose(...)``), ``scan``,
``checkpoint``/``remat`` and Flax's lifted transforms, so a jaxpr of a whole
training step says which equations ran under which policy:
:func:`innermost_policy` reads it back (the audit judges each matmul by the
compute dtype in force where it was traced), :func:`without_marks` removes
the marks from a name stack shown to users.

>>> policy = Policy("float32", "bfloat16", "float32")
>>> def f(x):
...   with policy_scope(policy):
...     return jnp.sin(x)
>>> (eqn,) = jax.make_jaxpr(f)(1.0).eqns
>>> name = str(eqn.source_info.name_stack)
>>> name
'jmp_lite.policy[params=float32,compute=bfloat16,output=float32]'
>>> innermost_policy(name) == policy, without_marks(f"jvp({name})/MLP/Dense_0")
(True, 'jvp(MLP)/Dense_0')
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import numpy as np

from jmp_lite._policy import Policy

_MARK = re.compile(r"jmp_lite\.policy\[params=(\w+),compute=(\w+),output=(\w+)\]")
# A mark and the separator after it, as it sits in a name stack ("mark/Dense_0").
_MARK_IN_STACK = re.compile(_MARK.pattern + "/?")
# JAX writes transforms around the first scope after them ("jvp(mark)/MLP"): once the mark is
# gone, the next scope moves in ("jvp()/MLP" -> "jvp(MLP)").
_EMPTY_TRANSFORM = re.compile(r"((?:[\w.]+\()+)(\)+)/([^/()]+)")


def scope_name(policy: Policy) -> str:
  """The name of ``policy``'s scope: ``jmp_lite.policy[params=...,compute=...,output=...]``.

  Args:
    policy: a :class:`~jmp_lite.Policy`.

  Returns:
    The name, with NumPy's dtype names.
  """
  dtypes = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  p, c, o = (np.dtype(d).name for d in dtypes)
  return f"jmp_lite.policy[params={p},compute={c},output={o}]"


def policy_scope(policy: Policy | None) -> contextlib.AbstractContextManager[None]:
  """A named scope marking the equations traced inside it as run under ``policy``.

  Args:
    policy: the policy the code inside runs under, or None (no mark).

  Returns:
    A context manager: :func:`jax.named_scope` of :func:`scope_name`, or a
    ``nullcontext`` for None.
  """
  if policy is None:
    return contextlib.nullcontext()
  return jax.named_scope(scope_name(policy))


@functools.lru_cache(maxsize=1024)
def innermost_policy(name_stack: str) -> Policy | None:
  """The policy of the innermost mark in a name stack.

  Args:
    name_stack: ``str`` of an equation's ``source_info.name_stack``, or the
      name stacks of nested calls joined by ``"/"`` (outermost first).

  Returns:
    The :class:`~jmp_lite.Policy` the last mark names, or None without a mark.
  """
  marks = _MARK.findall(name_stack)
  return Policy(*marks[-1]) if marks else None


def without_marks(name_stack: str) -> str:
  """A name stack with the policy marks removed (``"Model/Dense_0"``, as Flax names scopes).

  Args:
    name_stack: a name stack.

  Returns:
    ``name_stack`` without its marks.
  """
  if "jmp_lite.policy[" not in name_stack:
    return name_stack
  return _EMPTY_TRANSFORM.sub(r"\1\3\2", _MARK_IN_STACK.sub("", name_stack)).rstrip("/")
