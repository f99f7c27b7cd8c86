"""Matmuls and convolutions on 16-bit operands that accumulate in fp32.

A dot product of bf16 numbers rounded to bf16 after every addition loses the
small terms of long sums (bf16 keeps 8 significant bits, so adding 256 ones to
256 gives 256). Hardware avoids this by accumulating in fp32, but JAX only
*says* so when asked: ``jnp.dot(bf16, bf16)`` lowers to a ``dot_general`` with
``preferred_element_type=bfloat16``. The functions here ask explicitly, in the
forward *and* the backward pass:

.. math::

  y = \\mathrm{round}_{16}\\Big(\\sum_k x_{ik} w_{kj}\\Big)_{\\text{fp32}}, \\qquad
  \\bar x = \\mathrm{round}_{16}\\Big(\\sum_j \\bar y_{ij} w_{kj}\\Big)_{\\text{fp32}}, \\qquad
  \\bar w = \\mathrm{round}_{16}\\Big(\\sum_i x_{ik} \\bar y_{ij}\\Big)_{\\text{fp32}}

so all three matmuls of a layer read 16-bit operands (fast on tensor cores),
accumulate in fp32, and keep only the 16-bit operands as residuals. JAX's own
differentiation of ``dot_general(..., preferred_element_type=float32)`` would
instead feed an fp32 cotangent into the backward matmuls, which then run with
an fp32 operand.

They are drop-in replacements for :func:`jax.lax.dot_general`,
:func:`jax.lax.conv_general_dilated` and :func:`jax.numpy.einsum` (the hooks
Flax layers expose as ``dot_general``, ``conv_general_dilated`` and
``einsum_op``); operands that are not both 16-bit floats of one dtype go
straight to the JAX function. Reverse-mode differentiation (``grad``, ``vjp``),
``jit``, ``vmap``, ``scan`` and ``checkpoint`` work; forward-mode (``jvp``,
``jacfwd``) does not, as for any :func:`jax.custom_vjp` function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

_F32 = np.dtype(np.float32)


def is_16bit_float(dtype: Any) -> bool:
  """Whether ``dtype`` is float16 or bfloat16."""
  dtype = np.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def _accumulates_in_16bit(lhs: Any, rhs: Any, preferred_element_type: Any) -> bool:
  """Whether JAX would accumulate this product in a 16-bit type."""
  lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
  if lhs_dtype != rhs_dtype or not is_16bit_float(lhs_dtype):
    return False
  return preferred_element_type is None or np.dtype(preferred_element_type) == lhs_dtype


def _canonical_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: lax.DotDimensionNumbers,
  precision: lax.PrecisionLike = None,
  preferred_element_type: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """``dot_general`` computed as one ``[B, M, K] x [B, K, N]`` batched matmul.

  Same result as :func:`jax.lax.dot_general`. XLA's CPU runtime rejects some
  16-bit x 16-bit -> fp32 dots whose operands have several free dimensions
  ("Unsupported element type for DotThunk"); in canonical form every backend
  takes them, and XLA fuses the transposes and reshapes into the operand
  layouts, as its own dot canonicalization does. With an explicit
  ``out_sharding`` (which names the original output axes) the product is left
  as given.
  """
  if kwargs.get("out_sharding") is not None:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
  kwargs.pop("out_sharding", None)
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  lhs_contract, rhs_contract = tuple(lhs_contract), tuple(rhs_contract)
  lhs_batch, rhs_batch = tuple(lhs_batch), tuple(rhs_batch)
  lhs_free = tuple(d for d in range(lhs.ndim) if d not in lhs_contract + lhs_batch)
  rhs_free = tuple(d for d in range(rhs.ndim) if d not in rhs_contract + rhs_batch)
  size = lambda x, dims: int(np.prod([x.shape[d] for d in dims], dtype=np.int64))
  batch_shape = tuple(lhs.shape[d] for d in lhs_batch)
  b, k = size(lhs, lhs_batch), size(lhs, lhs_contract)
  lhs3 = lhs.transpose(lhs_batch + lhs_free + lhs_contract).reshape(b, size(lhs, lhs_free), k)
  rhs3 = rhs.transpose(rhs_batch + rhs_contract + rhs_free).reshape(b, k, size(rhs, rhs_free))
  out = lax.dot_general(
    lhs3, rhs3, (((2,), (1,)), ((0,), (0,))), precision, preferred_element_type, **kwargs
  )
  free_shape = tuple(lhs.shape[d] for d in lhs_free) + tuple(rhs.shape[d] for d in rhs_free)
  return out.reshape(batch_shape + free_shape)


def _eval_accumulating(closed: jex_core.ClosedJaxpr, *args: Any) -> list[Any]:
  """Evaluates ``closed`` with every 16-bit dot/conv accumulating in fp32.

  A minimal jaxpr interpreter: each ``dot_general``/``conv_general_dilated``
  whose result is 16-bit is bound with ``preferred_element_type=float32`` and
  rounded to its original type; every other equation is bound unchanged.
  Binding (rather than calling XLA) keeps it traceable under jit/vmap.
  """
  env: dict[Any, Any] = {}

  def read(var):
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  jaxpr = closed.jaxpr
  env.update(zip(jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    out_dtype = eqn.outvars[0].aval.dtype if eqn.outvars else None
    if eqn.primitive is lax.dot_general_p and is_16bit_float(out_dtype):
      params = dict(eqn.params, preferred_element_type=_F32)
      outs = [_canonical_dot_general(*invals, **params).astype(out_dtype)]
    elif eqn.primitive is lax.conv_general_dilated_p and is_16bit_float(out_dtype):
      params = dict(eqn.params, preferred_element_type=_F32)
      outs = [eqn.primitive.bind(*invals, **params).astype(out_dtype)]
    else:
      params, subfuns = eqn.primitive.get_bind_params(eqn.params), ()
      if isinstance(params, tuple):  # JAX < 0.7 returned (subfuns, params)
        subfuns, params = params
      outs = eqn.primitive.bind(*subfuns, *invals, **params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for var, val in zip(eqn.outvars, outs, strict=True):
      if not isinstance(var, jex_core.DropVar):
        env[var] = val
  return [read(v) for v in jaxpr.outvars]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _accumulate_in_fp32(op: Callable[..., jax.Array], lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """``op(lhs, rhs)`` for 16-bit operands, accumulated in fp32, rounded back."""
  return op(lhs, rhs, _F32).astype(lhs.dtype)


def _accumulate_fwd(op, lhs, rhs):
  return _accumulate_in_fp32(op, lhs, rhs), (lhs, rhs)


def _accumulate_bwd(op, residuals, cotangent):
  lhs, rhs = residuals

  def vjp_16bit(lhs, rhs, cotangent):
    return jax.vjp(lambda a, b: op(a, b, None), lhs, rhs)[1](cotangent)

  # JAX knows the transposed dots/convs (dimension numbers, padding, dilation);
  # trace them abstractly, then replay them with fp32 accumulation. The avals
  # are the unbatched ones even under vmap, whose tracers then batch the binds.
  spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
  closed = jax.make_jaxpr(vjp_16bit)(spec(lhs), spec(rhs), spec(cotangent))
  return tuple(_eval_accumulating(closed, lhs, rhs, cotangent))


_accumulate_in_fp32.defvjp(_accumulate_fwd, _accumulate_bwd)


def dot_general(
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  dimension_numbers: lax.DotDimensionNumbers,
  precision: lax.PrecisionLike = None,
  preferred_element_type: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """:func:`jax.lax.dot_general` that accumulates 16-bit operands in fp32.

  For two float16 (or two bfloat16) operands and no wider
  ``preferred_element_type``, the product and both of its gradients are
  computed with ``preferred_element_type=float32`` and rounded to the operand
  dtype. Anything else is passed to :func:`jax.lax.dot_general` unchanged.

  Example (a Flax layer built without editing its code path)::

    layer = nn.Dense(features=128, dot_general=jmp_lite.flax.dot_general)
  """
  if not _accumulates_in_16bit(lhs, rhs, preferred_element_type):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
  op = lambda a, b, accumulation: _canonical_dot_general(
    a, b, dimension_numbers, precision, accumulation, **kwargs
  )
  return _accumulate_in_fp32(op, jnp.asarray(lhs), jnp.asarray(rhs))


def conv_general_dilated(
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  *args: Any,
  preferred_element_type: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """:func:`jax.lax.conv_general_dilated` that accumulates 16-bit operands in fp32.

  Takes the same arguments; see :func:`dot_general` for when fp32 accumulation
  applies (the input and weight gradients accumulate in fp32 too).
  """
  if not _accumulates_in_16bit(lhs, rhs, preferred_element_type):
    # *args are conv_general_dilated's positional arguments before preferred_element_type.
    return lax.conv_general_dilated(  # type: ignore[misc]
      lhs,  # type: ignore[arg-type]
      rhs,  # type: ignore[arg-type]
      *args,
      preferred_element_type=preferred_element_type,
      **kwargs,
    )
  op = lambda a, b, accumulation: lax.conv_general_dilated(  # type: ignore[misc]
    a, b, *args, preferred_element_type=accumulation, **kwargs
  )
  return _accumulate_in_fp32(op, jnp.asarray(lhs), jnp.asarray(rhs))


def einsum(subscripts: str, /, *operands: Any, **kwargs: Any) -> jax.Array:
  """:func:`jax.numpy.einsum` whose contractions go through :func:`dot_general`.

  Contractions of two 16-bit operands accumulate in fp32 (forward and
  backward); the result keeps the operands' dtype.
  """
  if "_dot_general" in kwargs:
    raise TypeError("einsum already contracts with jmp_lite's dot_general; drop _dot_general.")
  return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)
