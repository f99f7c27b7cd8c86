"""The fp32_matmul check: a matmul the policy does not reach.

Under a 16/8-bit compute dtype, a forward-pass matmul with a float32 operand
runs in float32, at a fraction of the 16-bit throughput: with both operands
float32 (a layer built with ``dtype=jnp.float32`` keeps its dtype under a
policy), and with one, since JAX promotes the other (``q * np.float32(0.25)``
makes the query float32, and both attention einsums then run in float32). A
16-bit matmul with a float32 *result* (``preferred_element_type=jnp.float32``,
the logits layer of a policy) runs on 16-bit units and is what a policy asks for.

Each equation is judged by the compute dtype in force where it was traced (see
:mod:`jmp_lite._audit._policies`): the configured one, the policy scope around
it, the audited function's policy, or a policy among its arguments. A float32
matmul outside every policy scope while the arguments carry a 16-bit policy
says that the step ran without it (``model.apply`` instead of ``state.apply_fn``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite._audit import _graph
from jmp_lite._audit._checks._matmul import MATMULS
from jmp_lite._audit._policies import ComputePolicy
from jmp_lite._audit._registry import Hit, Site, register

# Elementwise ops through which a float32 operand promotes a 16-bit one.
_PROMOTING = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "select_n"})


def _wide(dtype: np.dtype | None) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4


def _where(site: Site, eqn: Any) -> str:
  """`` at file:line`` of ``eqn``'s user line, or ``""``."""
  info = eqn.source_info
  user, library = site.audit.frames.locate(getattr(info, "traceback", None))
  loc = user or library
  return f" at {loc}" if loc is not None else ""


def _widening_cast(site: Site, atom: Any) -> Any | None:
  """The nearest cast of a 16/8-bit float to float32 that ``atom`` is computed from, or None."""
  todo, seen = [atom], set()
  while todo and len(seen) < 64:
    a = todo.pop(0)
    if _jaxpr.is_literal(a) or a in seen:
      continue
    seen.add(a)
    eqn = site.graph.producer.get(a)
    if eqn is None:
      continue
    if eqn.primitive.name == "convert_element_type":
      src = _jaxpr.dtype_of(eqn.invars[0])
      if src is not None and jnp.issubdtype(src, jnp.floating) and not _wide(src):
        return eqn
    todo.extend(eqn.invars)
  return None


def _origin_of_operand(site: Site, atom: Any) -> str:
  """Where a float32 operand comes from: the op that made it float32, with its line."""
  if _jaxpr.is_literal(atom):
    return "is a float32 constant"
  producer = site.graph.producer.get(atom)
  if producer is None:
    return "is an input of the traced function (or of the jit, scan or checkpoint around it)"
  cast = _widening_cast(site, atom)
  if cast is None:
    return f"comes from {producer.primitive.name}{_where(site, producer)}"
  src = _jaxpr.dtype_of(cast.invars[0]).name
  users = site.graph.consumers.get(cast.outvars[0], [])
  promoter = next((e for e in users if e.primitive.name in _PROMOTING), None)
  if promoter is not None:
    how = (
      f"promoted from {src} to float32 by {promoter.primitive.name}{_where(site, promoter)}: "
      "its other operand is float32 (a np.float32 scalar or a float32 array; a Python scalar "
      f"would keep {src})"
    )
  else:
    how = f"cast from {src} to float32{_where(site, cast)}"
  if producer is cast or producer is promoter:
    return f"is {how}"
  made = f"comes from {producer.primitive.name}{_where(site, producer)}"
  return f"{made}, computed from a value {how}"


def _what(site: Site, compute: ComputePolicy, wide: list[str]) -> str:
  """What runs wide, naming the float32 operand that widened a mixed matmul."""
  eqn = site.eqn
  operands = dict(zip(("lhs", "rhs"), eqn.invars[:2], strict=True))
  c, prim = compute.dtype.name, eqn.primitive.name
  dtype = _jaxpr.dtype_of(operands[wide[0]]).name
  if len(wide) == 2:
    return (
      f"{prim} with {dtype} operands while the compute dtype is {c}: this matmul runs in "
      f"{dtype}, at a fraction of the throughput of {c} units."
    )
  (side,) = wide
  other = _jaxpr.dtype_of(operands["rhs" if side == "lhs" else "lhs"])
  other_name = other.name if other is not None else "other"
  return (
    f"{prim} of a {dtype} {side} ({_jaxpr.aval_str(operands[side])}) and a {other_name} "
    f"operand while the compute dtype is {c}: JAX promotes the {other_name} operand, so this "
    f"matmul runs in {dtype}, at a fraction of the throughput of {c} units. The {side} "
    f"{_origin_of_operand(site, operands[side])}."
  )


def _fix(site: Site, compute: ComputePolicy, mixed: bool) -> str:
  """How to fix it: depends on whether a policy runs around the matmul."""
  policies = site.audit.argument_policies
  if site.origin.policy is None and policies:
    policy = policies[0]
    if not site.audit.marked:
      return (
        f"The arguments carry the policy {policy} (e.g. a jmp_lite.flax.TrainState's "
        "policy), but no jmp_lite policy runs in this step: the step bypasses it, e.g. calls "
        "model.apply instead of state.apply_fn (NNX: calls the model instead of "
        "jmp_lite.flax.policy_view(model, policy)), and the whole model runs in float32. "
        "Run the model through the policy; code that casts by hand "
        f"(policy.cast_to_compute) left this operand uncast."
      )
    return (
      f"It runs outside the policy {policy} that the arguments carry (e.g. a "
      "jmp_lite.flax.TrainState's policy) and that runs elsewhere in this step: the step "
      "computes it without the policy, e.g. with model.apply beside state.apply_fn, or in its "
      f"own code (a loss); run it through the policy or cast its operands to {compute.dtype.name}."
    )
  if mixed:
    return (
      f"Keep both operands in {compute.dtype.name}: multiply by Python scalars (weakly typed) "
      "rather than np.float32 values or float32 arrays, or cast the float32 operand with "
      ".astype(other.dtype). If it is meant to run in float32, allow it (allow_scopes / "
      "allow_locations)."
    )
  return (
    "A layer built with dtype=jnp.float32 (or an explicit cast to float32) keeps its dtype "
    "under a policy: build it with the default dtype=None so the policy decides. If it is "
    "meant to stay in float32 (an fp32 override, e.g. the default one of nn.Embed, whose "
    "attend() is a matmul), allow it (allow_scopes / allow_locations)."
  )


@register(
  "fp32_matmul",
  "dot_general / convolution with a float32 operand while the compute dtype is 16/8-bit",
  primitives=MATMULS,
)
def fp32_matmul(site: Site) -> Hit | None:
  """A forward-pass matmul with a float32 operand under a 16/8-bit compute dtype."""
  if site.origin.backward or site.derivative_of() is not None:
    return None  # the backward pass mirrors the forward one: report the forward matmul
  compute = site.audit.compute_at(site.origin)
  if compute is None:
    return None
  lhs, rhs = site.eqn.invars[:2]
  wide = [side for side, a in (("lhs", lhs), ("rhs", rhs)) if _wide(_jaxpr.dtype_of(a))]
  if not wide:
    return None
  return Hit(
    compute.dtype,
    f"{_what(site, compute, wide)} {_fix(site, compute, mixed=len(wide) == 1)}",
    size=_graph.contraction_size(site.eqn),
  )
