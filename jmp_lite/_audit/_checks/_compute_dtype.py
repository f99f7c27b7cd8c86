"""The fp32_matmul check: a matmul the policy does not reach.

Under a 16/8-bit compute dtype, a forward-pass matmul with float32 operands
runs at a fraction of the 16-bit throughput: a layer built with
``dtype=jnp.float32`` keeps its dtype under a policy. Only with a known
compute dtype (``AuditConfig.compute_dtype`` or the audited function's policy).
"""

from __future__ import annotations

import jax.numpy as jnp

from jmp_lite import _jaxpr
from jmp_lite._audit import _graph
from jmp_lite._audit._checks._matmul import MATMULS
from jmp_lite._audit._registry import Hit, Site, register


@register(
  "fp32_matmul",
  "dot_general / convolution in float32 while the compute dtype is 16/8-bit",
  primitives=MATMULS,
)
def fp32_matmul(site: Site) -> Hit | None:
  """A forward-pass matmul with float32 operands under a 16/8-bit compute dtype."""
  eqn, compute = site.eqn, site.audit.compute_dtype
  if compute is None or site.origin.backward or site.derivative_of() is not None:
    return None  # the backward pass mirrors the forward one: report the forward matmul
  lhs, rhs = (_jaxpr.dtype_of(a) for a in eqn.invars[:2])
  wide = [d for d in (lhs, rhs) if d is not None and jnp.issubdtype(d, jnp.floating)]
  if len(wide) < 2 or min(d.itemsize for d in wide) < 4:
    return None
  wide_name = wide[0].name
  return Hit(
    compute,
    f"{eqn.primitive.name} with {wide_name} operands while the compute dtype is "
    f"{compute.name}: this matmul runs in {wide_name}, at a fraction of the throughput of "
    f"{compute.name} units. A layer built with dtype=jnp.float32 (or an explicit cast to "
    "float32) keeps its dtype under a policy: build it with the default dtype=None so the "
    "policy decides. If it is meant to stay in float32 (an fp32 override, e.g. the default "
    "one of nn.Embed, whose attend() is a matmul), allow it (allow_scopes / allow_locations).",
    size=_graph.contraction_size(eqn),
  )
