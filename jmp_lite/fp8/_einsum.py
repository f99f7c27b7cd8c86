"""Two-operand einsum as one fp8 matmul: the subscript parser and its plan (private)."""

from __future__ import annotations

import collections
import string
from typing import NamedTuple, Unpack

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite.fp8._matmul import DotOptions, check_operand
from jmp_lite.fp8._recipes import dot_general
from jmp_lite.fp8._scaling import Fp8DotAmax, Fp8DotState


def _check_letters(subscripts: str, operands: list[str], output: str) -> None:
  for spec in (*operands, output):
    letters = spec.replace("...", "", 1)
    if not all(c in string.ascii_letters for c in letters):
      raise ValueError(f"Invalid subscripts {spec!r} in {subscripts!r}: use letters and one '...'.")


def _ellipsis_sizes(subscripts: str, operands: list[str], ndims: tuple[int, int]) -> list[int]:
  """How many axes ``...`` stands for in each operand."""
  sizes = []
  for spec, ndim, side in zip(operands, ndims, ("lhs", "rhs"), strict=True):
    named = len(spec.replace("...", ""))
    n_ellipsis = ndim - named if "..." in spec else 0
    if n_ellipsis < 0 or ("..." not in spec and named != ndim):
      raise ValueError(
        f"Subscripts {spec!r} do not fit the {side} operand of rank {ndim} in {subscripts!r}."
      )
    sizes.append(n_ellipsis)
  return sizes


def einsum_subscripts(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
  """Expands ``...`` and the implicit output; returns one letter per axis.

  Ellipsis axes are right-aligned between the operands (NumPy broadcasting);
  an implicit output is the ellipsis followed by the letters used exactly once,
  sorted, as in NumPy.

  Args:
    subscripts: a two-operand einsum equation such as ``"bd,df->bf"``.
    lhs_ndim: the rank of the left operand.
    rhs_ndim: the rank of the right operand.

  Returns:
    ``(lhs, rhs, output)``: one letter per axis of each.

  Raises:
    ValueError: naming ``subscripts`` if they do not describe a matmul of
      operands of these ranks.

  >>> einsum_subscripts("...d,df", 3, 2)
  ('abd', 'df', 'abf')
  """
  if not isinstance(subscripts, str):
    raise TypeError(f"subscripts must be a string such as 'bd,df->bf', got {subscripts!r}.")
  eq = subscripts.replace(" ", "")
  inputs, arrow, output = eq.partition("->")
  operands = inputs.split(",")
  if len(operands) != 2 or "->" in output:
    raise ValueError(
      f"fp8 einsum takes exactly two operands, e.g. 'bd,df->bf'; got {subscripts!r}."
    )
  _check_letters(subscripts, operands, output)
  spare = [c for c in string.ascii_letters if c not in eq]
  counts = _ellipsis_sizes(subscripts, operands, (lhs_ndim, rhs_ndim))
  ellipsis = "".join(spare[: max(counts)])
  lhs, rhs = (
    spec.replace("...", ellipsis[len(ellipsis) - n :])
    for spec, n in zip(operands, counts, strict=True)
  )
  if arrow:
    out = output.replace("...", ellipsis)
  else:
    uses = collections.Counter(operands[0].replace("...", "") + operands[1].replace("...", ""))
    out = ellipsis + "".join(sorted(c for c, n in uses.items() if n == 1))
  for spec, what in ((lhs, "lhs"), (rhs, "rhs"), (out, "output")):
    if len(set(spec)) != len(spec):
      raise ValueError(
        f"Repeated index in the {what} of {subscripts!r}: fp8 einsum supports matmuls, "
        "not diagonals or traces."
      )
  missing = set(out) - set(lhs) - set(rhs)
  if missing:
    raise ValueError(f"Output indices {sorted(missing)} of {subscripts!r} appear in no operand.")
  return lhs, rhs, out


class _EinsumPlan(NamedTuple):
  lhs_sum: tuple[int, ...]
  rhs_sum: tuple[int, ...]
  dims: tuple
  perm: tuple[int, ...]


def _einsum_plan(subscripts: str, lhs_shape: tuple, rhs_shape: tuple) -> _EinsumPlan:
  lhs, rhs, out = einsum_subscripts(subscripts, len(lhs_shape), len(rhs_shape))
  for c in set(lhs) & set(rhs):
    if lhs_shape[lhs.index(c)] != rhs_shape[rhs.index(c)]:
      raise ValueError(
        f"Index {c!r} of {subscripts!r} has size {lhs_shape[lhs.index(c)]} in lhs and "
        f"{rhs_shape[rhs.index(c)]} in rhs."
      )
  # Indices only one operand has and the output drops are summed before the
  # matmul (as jnp.einsum does); the fp8 "input" is then the summed operand.
  lhs_sum = tuple(i for i, c in enumerate(lhs) if c not in rhs and c not in out)
  rhs_sum = tuple(i for i, c in enumerate(rhs) if c not in lhs and c not in out)
  lhs = "".join(c for i, c in enumerate(lhs) if i not in lhs_sum)
  rhs = "".join(c for i, c in enumerate(rhs) if i not in rhs_sum)
  contract = [c for c in lhs if c in rhs and c not in out]
  batch = [c for c in lhs if c in rhs and c in out]
  dims = (
    (tuple(lhs.index(c) for c in contract), tuple(rhs.index(c) for c in contract)),
    (tuple(lhs.index(c) for c in batch), tuple(rhs.index(c) for c in batch)),
  )
  result = batch + [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
  return _EinsumPlan(lhs_sum, rhs_sum, dims, tuple(result.index(c) for c in out))


def einsum_dot_shapes(subscripts: str, lhs: jax.Array, rhs: jax.Array) -> tuple:
  """The operand shapes and dimension numbers of the matmul :func:`einsum` computes.

  Args:
    subscripts: the equation.
    lhs: the input.
    rhs: the kernel.

  Returns:
    ``(lhs_shape, rhs_shape, dimension_numbers)``, after the indices only one
    operand has are summed.
  """
  plan = _einsum_plan(subscripts, tuple(lhs.shape), tuple(rhs.shape))
  lhs_shape = tuple(s for i, s in enumerate(lhs.shape) if i not in plan.lhs_sum)
  rhs_shape = tuple(s for i, s in enumerate(rhs.shape) if i not in plan.rhs_sum)
  return lhs_shape, rhs_shape, plan.dims


def einsum(
  subscripts: str,
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  state: Fp8DotState | None = None,
  amax: Fp8DotAmax | None = None,
  **options: Unpack[DotOptions],
) -> jax.Array:
  r"""A two-operand einsum computed by one fp8 :func:`dot_general`.

  .. math:: y_{bf} = \Big(\sum_d q(x)_{bd}\, q(k)_{df}\Big)_{\text{fp32}} s_x s_k
    \qquad \text{(for } \texttt{"bd,df->bf"}\text{)}

  ``lhs`` is the input and ``rhs`` the kernel for the state's naming. Supports
  contractions, batch indices, outer products, ``...`` and the implicit output
  form; indices repeated within one operand (diagonals) are rejected. Indices
  only one operand has and the output drops are summed first, in the
  operand's dtype (as ``jnp.einsum`` does).

  Args:
    subscripts: the equation, e.g. ``"btd,df->btf"``.
    lhs: the input, a floating array in 16 or 32 bits.
    rhs: the kernel, a floating array in 16 or 32 bits.
    state: this matmul's :class:`Fp8DotState` (delayed scaling), or ``None``.
    amax: the probe, as in :func:`dot_general`.
    **options: the keyword options of :func:`dot_general`: ``config``,
      ``loss_scale``, ``precision``, ``preferred_element_type``,
      ``out_sharding``.

  Returns:
    The einsum, with gradients flowing to ``lhs`` and ``rhs`` and the
    observations to ``amax``.

  >>> x, k = jnp.ones((2, 3, 4)), jnp.full((4, 5), 0.25)
  >>> einsum("btd,df->bft", x, k).shape
  (2, 5, 3)
  """
  lhs = check_operand(lhs, "lhs")
  rhs = check_operand(rhs, "rhs")
  plan = _einsum_plan(subscripts, tuple(lhs.shape), tuple(rhs.shape))
  if plan.lhs_sum:
    lhs = jnp.sum(lhs, axis=plan.lhs_sum, dtype=lhs.dtype)
  if plan.rhs_sum:
    rhs = jnp.sum(rhs, axis=plan.rhs_sum, dtype=rhs.dtype)
  transposed = plan.perm != tuple(range(len(plan.perm)))
  out_sharding = options.get("out_sharding")
  # A transposed result is resharded after the transpose, not by the matmul.
  matmul_options: DotOptions = {**options, "out_sharding": None if transposed else out_sharding}
  out = dot_general(lhs, rhs, plan.dims, state, amax, **matmul_options)
  if not transposed:
    return out
  out = lax.transpose(out, plan.perm)
  if out_sharding is not None:
    out = jax.sharding.reshard(out, out_sharding)
  return out
