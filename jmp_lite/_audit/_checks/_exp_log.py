r"""Checks of exponentials and logarithms: softmax, log-sum-exp, exp, log, log-sigmoid.

An ``exp`` in 16/8 bits is reported once, as the pattern it belongs to: a
softmax (``exp`` divided by its own sum), a log-sum-exp (the log of that sum),
or a bare ``exp`` (fp16 overflows above :math:`\ln 65504 \approx 11.1`). The
pattern's sum, division or log is covered by the finding, not reported again.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from jmp_lite import _dtypes as dtypes
from jmp_lite._audit import _graph
from jmp_lite._audit._registry import Hit, Site, register

_LOGS = frozenset({"log", "log1p"})


class _Normalized(NamedTuple):
  """How an exp's result is normalized: the pattern, its length and its other equations."""

  kind: str  # "softmax" or "logsumexp"
  size: int
  covers: tuple[Any, ...]


def _normalization(site: Site) -> _Normalized | None:
  """Whether the exp of ``site`` is divided by its sum (softmax) or its sum's log is taken."""
  graph = site.graph
  numerators = graph.forward(site.eqn.outvars[0])
  for red in graph.consumers_of(numerators, {"reduce_sum"}):
    sums = set(graph.forward(red.outvars[0]))
    # logsumexp takes log(abs(sum)) (the sign is kept apart).
    for c in list(graph.consumers_of(list(sums), {"abs"})):
      sums.update(graph.forward(c.outvars[0]))
    n = _graph.reduced_size(red)
    for div in graph.consumers_of(numerators, {"div"}):
      if div.invars[0] in numerators and div.invars[1] in sums:
        return _Normalized("softmax", n, (div, red))
    for log in graph.consumers_of(list(sums), _LOGS):
      return _Normalized("logsumexp", n, (log, red))
  return None


# What goes wrong in each normalization, formatted with the dtype, its FormatInfo and the length.
_NORMALIZATION_MESSAGES = {
  "softmax": (
    "softmax over {n} values computed in {dtype}: exp and the normalizing division run in "
    "{dtype} ({info.mantissa_bits} mantissa bits, relative error ~{info.epsilon:.0e}); "
    "probabilities below {info.min_subnormal:.1e} become 0 (their log is -inf) and long rows "
    "lose the small ones. Compute it in float32: jax.nn.softmax(x.astype(jnp.float32)), then "
    "cast the result."
  ),
  "logsumexp": (
    "log-sum-exp over {n} values in {dtype} (log_softmax / cross-entropy): exp and log run in "
    "{dtype}, so the loss is accurate to only ~{info.epsilon:.0e} relative and terms below "
    "{info.min_subnormal:.1e} vanish. Compute the loss from float32 logits "
    "(policy.cast_to_output)."
  ),
}


def _normalization_hit(site: Site, kind: str) -> Hit | None:
  """A Hit for a 16/8-bit exp that is normalized as ``kind`` ("softmax", "logsumexp")."""
  dtype = site.audit.low(site.eqn.outvars[0])
  if dtype is None:
    return None
  pattern = _normalization(site)
  if pattern is None or pattern.kind != kind:
    return None
  info = dtypes.format_info(dtype)
  text = _NORMALIZATION_MESSAGES[kind].format(dtype=dtype.name, info=info, n=pattern.size)
  return Hit(dtype, text, size=pattern.size, covers=pattern.covers)


@register("softmax", "exp / sum(exp) normalization in 16/8 bits", primitives=_graph.EXPONENTIALS)
def softmax(site: Site) -> Hit | None:
  """``exp(x - max) / sum(exp(x - max))`` with the exp in a 16/8-bit format."""
  return _normalization_hit(site, "softmax")


@register(
  "logsumexp",
  "log(sum(exp(x))) (log_softmax, cross-entropy) in 16/8 bits",
  primitives=_graph.EXPONENTIALS,
)
def logsumexp(site: Site) -> Hit | None:
  """``log(sum(exp(x)))`` with the exp in a 16/8-bit format."""
  return _normalization_hit(site, "logsumexp")


@register("exp", "exp, exp2, expm1 in 16/8 bits", primitives=_graph.EXPONENTIALS)
def exp(site: Site) -> Hit | None:
  """An exponential in a 16/8-bit format that is no softmax or log-sum-exp."""
  eqn = site.eqn
  dtype = site.audit.low(eqn.outvars[0])
  if dtype is None or _normalization(site) is not None:
    return None
  info = dtypes.format_info(dtype)
  if _graph.nonpositive_argument(site.graph, eqn):
    what = f"underflows to 0 below {math.log(info.min_subnormal):.1f}"
  else:
    what = (
      f"overflows to inf for inputs above {math.log(info.max):.1f} and underflows to 0 "
      f"below {math.log(info.min_subnormal):.1f}"
    )
  return Hit(
    dtype,
    f"{eqn.primitive.name} in {dtype.name} {what}; its result is accurate to "
    f"~{info.epsilon:.0e} relative. Compute it in float32.",
  )


@register("log", "log, log1p in 16/8 bits", primitives=_LOGS)
def log(site: Site) -> Hit | None:
  """A logarithm in a 16/8-bit format."""
  dtype = site.audit.low(site.eqn.outvars[0])
  if dtype is None:
    return None
  info = dtypes.format_info(dtype)
  return Hit(
    dtype,
    f"{site.eqn.primitive.name} in {dtype.name}: an input that underflowed to 0 (below "
    f"{info.min_subnormal:.1e}) gives -inf, and the result is only accurate to "
    f"~{info.epsilon:.0e} relative. Take logs in float32.",
  )


@register("logistic", "sigmoid feeding a log in 16/8 bits", primitives={"logistic"})
def logistic(site: Site) -> Hit | None:
  """A 16/8-bit sigmoid whose result (or one minus it) reaches a log."""
  dtype = site.audit.low(site.eqn.outvars[0])
  if dtype is None:
    return None
  # A sigmoid gate (SiLU, GLU) in 16 bits is fine; a sigmoid whose log is
  # taken (a binary cross-entropy written by hand) is not.
  graph = site.graph
  reach = list(graph.forward(site.eqn.outvars[0]))
  for c in list(graph.consumers_of(list(reach), {"sub", "neg"})):
    reach.extend(graph.forward(c.outvars[0]))
  for log_eqn in graph.consumers_of(reach, _LOGS):
    info = dtypes.format_info(dtype)
    return Hit(
      dtype,
      f"log of a sigmoid computed in {dtype.name}: sigmoid(x) rounds to exactly 1 for "
      f"x > {math.log(4 / info.epsilon):.1f} and to 0 for "
      f"x < {math.log(info.min_subnormal / 2):.1f}, so log(sigmoid) or log(1 - sigmoid) "
      "is -inf. Use jax.nn.log_sigmoid or optax.sigmoid_binary_cross_entropy on float32 "
      "logits.",
      covers=(log_eqn,),
    )
  return None
