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
it, else (for what ``jax.grad`` differentiates, not an optimizer's update) the
audited function's policy or a policy among its arguments. A float32 matmul
outside every policy scope while the arguments carry a 16-bit policy says that
the step ran without it (``model.apply`` instead of ``state.apply_fn``). When
JAX or Flax made both operands float32 (Flax's ``promote_dtype`` casts the
other operand up to a promoted one's float32), the finding names the promotion,
following values out of the ``jit``, ``scan`` and ``checkpoint`` around them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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


def _narrow_float(dtype: np.dtype | None) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and not _wide(dtype)


def _promoter(site: Site, graph: _graph.Graph, cast: Any) -> Any | None:
  """The op that promoted ``cast``'s 16/8-bit operand to float32, or None for a cast by hand.

  JAX casts the narrow operand of an op whose other operand is float32 and not
  weakly typed (a ``np.float32`` scalar, a float32 array; a Python scalar is
  weak and keeps the narrow dtype), on behalf of that op: the promoter is an
  elementwise consumer of the cast with such an operand, traced from the same
  line (a cast written by hand, ``x.astype(jnp.float32)``, has its own).
  """
  out, line = cast.outvars[0], _lines(site, cast)
  for eqn in graph.consumers.get(out, ()):
    if eqn.primitive.name not in _PROMOTING or _lines(site, eqn) != line:
      continue
    others = [a for a in eqn.invars if a is not out]
    if any(_wide(_jaxpr.dtype_of(a)) and not _weak(a) for a in others):
      return eqn
  return None


def _lines(site: Site, eqn: Any) -> tuple:
  """The user's and the library's line ``eqn`` was traced from."""
  return site.audit.frames.locate(getattr(eqn.source_info, "traceback", None))


def _weak(atom: Any) -> bool:
  return bool(getattr(getattr(atom, "aval", None), "weak_type", False))


class _Widening(NamedTuple):
  """A cast of a 16/8-bit float to float32 that a value is computed from."""

  cast: Any
  promoter: Any | None  # the op whose float32 operand promoted it (None: cast by hand)
  source: np.dtype  # the narrow dtype cast from


def _widening(site: Site, loc: _graph.Located) -> _Widening | None:
  """The nearest promotion to float32 that ``loc`` is computed from, else the nearest cast.

  Only float32 values are followed back: a 16-bit value on the way was computed before
  the float32 chain began.
  """
  first = None
  wide = lambda atom: _wide(_jaxpr.dtype_of(atom))
  for eqn, where in _graph.upstream(site.audit.graphs, loc, wide):
    if eqn.primitive.name != "convert_element_type":
      continue
    src = _jaxpr.dtype_of(eqn.invars[0])
    if src is None or not _narrow_float(src) or not _wide(_jaxpr.dtype_of(eqn.outvars[0])):
      continue
    promoter = _promoter(site, where.graph, eqn)
    if promoter is not None:
      return _Widening(eqn, promoter, src)
    first = first or _Widening(eqn, None, src)
  return first


def _cast_up(site: Site, loc: _graph.Located) -> np.dtype | None:
  """The 16/8-bit dtype an operand was cast up from right before the matmul, or None."""
  for _ in range(8):
    loc, eqn = _graph.defining(loc)
    if eqn is None:
      return None
    if eqn.primitive.name == "convert_element_type":
      src = _jaxpr.dtype_of(eqn.invars[0])
      return src if _narrow_float(src) else None
    if eqn.primitive.name not in _graph.TRANSPARENT or not eqn.invars:
      return None
    loc = _graph.Located(loc.graph, eqn.invars[0], loc.calls)
  return None


def _promoted_side(site: Site) -> str | None:
  """With both operands float32: the side a promotion widened, the other cast up to match."""
  locs = _operands(site)
  for side, other in (("lhs", "rhs"), ("rhs", "lhs")):
    widening = _widening(site, locs[side])
    if widening is not None and widening.promoter is not None:
      if _cast_up(site, locs[other]) is not None:
        return side
  return None


def _operands(site: Site) -> dict[str, _graph.Located]:
  lhs, rhs = site.eqn.invars[:2]
  return {
    "lhs": _graph.Located(site.graph, lhs, site.calls),
    "rhs": _graph.Located(site.graph, rhs, site.calls),
  }


def _input_of(where: _graph.Located) -> str:
  """What an operand with no producer is an input of."""
  if not where.calls:
    return "is an input of the traced function"
  call = where.calls[-1].eqn
  name = call.params.get("name")
  named = f" {name!r}" if isinstance(name, str) else ""
  return f"is an input of the {call.primitive.name}{named} around it"


def _origin_of_operand(site: Site, loc: _graph.Located) -> str:
  """Where a float32 operand comes from: the op that made it float32, with its line."""
  if _jaxpr.is_literal(loc.atom):
    return "is a float32 constant"
  where, producer = _graph.defining(loc)
  if producer is None:
    return "is a float32 constant" if _jaxpr.is_literal(where.atom) else _input_of(where)
  widening = _widening(site, loc)
  if widening is None:
    return f"comes from {producer.primitive.name}{_where(site, producer)}"
  src, promoter = widening.source.name, widening.promoter
  if promoter is not None:
    how = (
      f"promoted from {src} to float32 by {promoter.primitive.name}{_where(site, promoter)}: "
      "its other operand is float32 (a np.float32 scalar or a float32 array; a Python scalar "
      f"would keep {src})"
    )
  else:
    how = f"cast from {src} to float32{_where(site, widening.cast)}"
  if producer is widening.cast or producer is promoter:
    return f"is {how}"
  made = f"comes from {producer.primitive.name}{_where(site, producer)}"
  return f"{made}, computed from a value {how}"


def _what(site: Site, compute: ComputePolicy, wide: list[str], side: str | None) -> str:
  """What runs wide, naming the operand that widened it (``side``) when one did."""
  eqn = site.eqn
  operands = dict(zip(("lhs", "rhs"), eqn.invars[:2], strict=True))
  c, prim = compute.dtype.name, eqn.primitive.name
  dtype = _name(_jaxpr.dtype_of(operands[wide[0]]))
  if side is None:
    return (
      f"{prim} with {dtype} operands while the compute dtype is {c}: this matmul runs in "
      f"{dtype}, at a fraction of the throughput of {c} units."
    )
  other = "rhs" if side == "lhs" else "lhs"
  origin = _origin_of_operand(site, _operands(site)[side])
  if len(wide) == 2:
    src = _name(_cast_up(site, _operands(site)[other]))
    return (
      f"{prim} with {dtype} operands while the compute dtype is {c}: the {other} "
      f"({_jaxpr.aval_str(operands[other])}) is cast up from {src} to match the {dtype} {side} "
      f"({_jaxpr.aval_str(operands[side])}), as JAX and Flax promote mixed operands (Flax's "
      "promote_dtype in nn.Dense and nn.dot_product_attention), so this matmul runs in "
      f"{dtype}, at a fraction of the throughput of {c} units. The {side} {origin}."
    )
  other_name = _name(_jaxpr.dtype_of(operands[other]))
  return (
    f"{prim} of a {dtype} {side} ({_jaxpr.aval_str(operands[side])}) and a {other_name} "
    f"operand while the compute dtype is {c}: JAX promotes the {other_name} operand, so this "
    f"matmul runs in {dtype}, at a fraction of the throughput of {c} units. The {side} {origin}."
  )


def _name(dtype: np.dtype | None) -> str:
  return "other" if dtype is None else dtype.name


def _fix(site: Site, compute: ComputePolicy, mixed: bool) -> str:
  """How to fix it: depends on where the compute dtype comes from (``compute.source``)."""
  policy = compute.policy
  if compute.source == "arguments":
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
  if compute.source == "function":
    judged = f"It is judged by the audited function's policy {policy} (its policy attribute). "
    return judged + _operand_fix(compute, mixed)
  return _operand_fix(compute, mixed)


def _operand_fix(compute: ComputePolicy, mixed: bool) -> str:
  """How to keep the operands in the compute dtype where the policy runs."""
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
  side = wide[0] if len(wide) == 1 else _promoted_side(site)
  return Hit(
    compute.dtype,
    f"{_what(site, compute, wide, side)} {_fix(site, compute, mixed=side is not None)}",
    size=_graph.contraction_size(site.eqn),
  )
