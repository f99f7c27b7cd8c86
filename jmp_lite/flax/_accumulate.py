r"""Matmuls and convolutions on 16-bit operands, as lean as the hardware allows.

A dot product of bf16 numbers rounded to bf16 after every addition loses the
small terms of long sums (bf16 keeps 8 significant bits, so adding 256 ones to
256 gives 256). Matrix hardware does not do that: it multiplies 16-bit
operands, accumulates in fp32 and rounds once into a 16-bit result,

.. math::

  y = \mathrm{round}_{16}\Big(\sum_k x_{ik} w_{kj}\Big)_{\text{fp32}}.

What each backend does with a ``dot_general`` of two 16-bit operands and a
16-bit result (measured: ``tests/flax/test_accumulate.py`` on XLA:CPU,
``benchmarks/gpu.py``'s probe on an H200; docs/benchmarks.md):

* **XLA:GPU** accumulates in fp32 (cuBLASLt and Triton gemms, long
  contractions included) and rounds once. It honours the algorithm preset
  ``BF16_BF16_F32`` (``F16_F16_F32``), but then emits every declared dot as a
  Triton gemm fusion, taking cuBLAS out of its autotuner's choices.
* **XLA:TPU**: the matrix unit accumulates bf16 products in fp32. Declaring
  ``BF16_BF16_F32`` compiles to the same program as declaring nothing
  (``tests/test_deviceless_benchmark.py``; the whole LM step of
  ``benchmarks/deviceless.py`` on a v5e too).
* **XLA:CPU** accumulates 16-bit dots in fp32 whatever the program says (it
  computes them in fp32), and rejects the presets for fp16 and for dots with a
  single output element. It cannot run every
  16-bit x 16-bit -> fp32 matmul, so the wide gradients below take fp32
  operands there (``jmp_lite._matmul_precision.bind_wide`` says why).
* Convolutions: cuDNN, the TPU and XLA:CPU accumulate 16-bit convolutions in
  fp32 (fp16 on cuDNN: fp32 partial sums rounded more than once); JAX drops an
  algorithm preset on ``conv_general_dilated``, so none is declared.

So no preset buys anything anywhere, none is declared, and the program needs
no platform when it is traced. The kernels here emit exactly the 16-bit
matmuls of a Flax layer built with ``dtype=jnp.bfloat16`` (16-bit operands,
residuals and results, forward and backward, so the fast gemm paths and half
the bytes).
A wider result buys no accuracy there (the accumulator is fp32 already) and
costs bandwidth and memory. Two options keep fp32 where it is consumed in fp32:

* ``output_dtype=jnp.float32``: the product leaves the matmul in fp32,
  unrounded (for the layer whose output is the model's fp32 output, e.g. the
  logits before the loss). Its gradients are still 16-bit matmuls: the fp32
  cotangent is rounded once to the operand dtype.
* ``rhs_grad_dtype=jnp.float32``: the weight gradient (the gradient of
  ``rhs``, a Flax layer's kernel) leaves its matmul in fp32 and is rounded
  once to ``rhs``'s dtype afterwards. Under data parallelism or FSDP the
  cross-device sum of its per-device partial products then runs in fp32 (at
  twice the bytes), rounding once instead of at every step of the reduction.
  The default reduces in the 16-bit dtype, as Flax's 16-bit layers do.

They are drop-in replacements for :func:`jax.lax.dot_general`,
:func:`jax.lax.conv_general_dilated` and :func:`jax.numpy.einsum` (the hooks
Flax layers expose as ``dot_general``, ``conv_general_dilated`` and
``einsum_op``); operands that are not both 16-bit floats of one dtype go
straight to the JAX function. Without the options they are JAX's own
operations, differentiable in both modes; with an option, reverse mode only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _compat, _jaxpr, _validation
from jmp_lite._matmul_precision import bind_wide, is_16bit_float

_F32 = np.dtype(np.float32)


def _narrow(lhs: Any, rhs: Any, preferred_element_type: Any) -> np.dtype | None:
  """The 16-bit operand dtype if this is a 16-bit x 16-bit product with a 16-bit result."""
  lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
  if lhs_dtype != rhs_dtype or not is_16bit_float(lhs_dtype):
    return None
  if preferred_element_type is not None and np.dtype(preferred_element_type) != lhs_dtype:
    return None
  return np.dtype(lhs_dtype)


class _Options(NamedTuple):
  """The static part of a product that needs its own VJP (see the module docstring)."""

  output_dtype: np.dtype | None  # a wide result, left unrounded
  grad_dtypes: tuple[np.dtype | None, np.dtype | None]  # lhs, rhs gradients leave their matmuls in


def _wide(value: Any, name: str) -> np.dtype | None:
  if value is None:
    return None
  f32 = lambda d: d == _F32
  return _validation.check_dtype(value, name, f32, "None or float32", as_given=True)


def _options(output_dtype: Any, lhs_grad_dtype: Any, rhs_grad_dtype: Any) -> _Options | None:
  options = _Options(
    _wide(output_dtype, "output_dtype"),
    (_wide(lhs_grad_dtype, "lhs_grad_dtype"), _wide(rhs_grad_dtype, "rhs_grad_dtype")),
  )
  return None if options == _Options(None, (None, None)) else options


def _spec(x: Any) -> jax.ShapeDtypeStruct:
  # Unbatched shapes even under vmap, whose tracers then batch the replayed binds; the
  # sharding under explicit mesh axes, where a transpose must return the operand's; inside
  # shard_map, the mesh axes the value varies over, or a transpose would mistype its cotangent.
  return _compat.shape_dtype_struct(x)


def _replay_wide(closed: Any, wide: np.dtype, *args: Any) -> list[Any]:
  """Evaluates ``closed`` with every 16-bit product leaving its matmul in ``wide``.

  Each ``dot_general``/``conv_general_dilated`` with a 16-bit result is bound
  with ``preferred_element_type=wide`` (by ``jmp_lite._matmul_precision.bind_wide``);
  every other equation is bound as it is. Binding (rather than calling XLA) keeps it
  traceable under jit/vmap.
  """
  env: dict[Any, Any] = {}

  def read(var):
    return var.val if _jaxpr.is_literal(var) else env[var]

  jaxpr = closed.jaxpr
  env.update(zip(jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  drop = _compat.extend_core().DropVar
  for eqn in jaxpr.eqns:
    products = (lax.dot_general_p, lax.conv_general_dilated_p)
    if eqn.primitive in products and is_16bit_float(eqn.outvars[0].aval.dtype):
      results = [bind_wide(eqn.primitive, eqn.params, wide, *(read(v) for v in eqn.invars))]
    else:
      results = _compat.bind(eqn.primitive, eqn.params, *(read(v) for v in eqn.invars))
    for var, val in zip(eqn.outvars, results, strict=True):
      if not isinstance(var, drop):
        env[var] = val
  return [read(v) for v in jaxpr.outvars]


def _transposed(op: Callable[..., jax.Array], operands: tuple, side: int, cotangent, wide):
  """The gradient of ``operands[side]`` (the other fixed): a 16-bit product, or a wide one."""
  other = operands[1 - side]

  def transpose(other, g):
    fn = (lambda x: op(x, other, None)) if side == 0 else (lambda x: op(other, x, None))
    return jax.linear_transpose(fn, _spec(operands[side]))(g)[0]

  if wide is None:
    return transpose(other, cotangent)
  # JAX knows the transposed product (dimension numbers, padding, dilation):
  # trace it abstractly, then replay it with a wide result.
  closed = jax.make_jaxpr(transpose)(_spec(other), _spec(cotangent))
  (grad,) = _replay_wide(closed, wide, other, cotangent)
  return grad.astype(operands[side].dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _product(op: Callable[..., jax.Array], options: _Options, lhs: jax.Array, rhs: jax.Array):
  """``op(lhs, rhs, result_dtype)`` with a wide result and/or wide gradients."""
  return op(lhs, rhs, options.output_dtype)


def _product_fwd(op, options, lhs, rhs):
  return _product(op, options, lhs, rhs), (lhs, rhs)


def _product_bwd(op, options, residuals, cotangent):
  # The gradients are 16-bit products like the forward pass: a wide cotangent
  # is rounded once here, so no backward matmul has an fp32 operand.
  cotangent = cotangent.astype(residuals[0].dtype)
  return tuple(
    _transposed(op, residuals, side, cotangent, options.grad_dtypes[side]) for side in (0, 1)
  )


_product.defvjp(_product_fwd, _product_bwd)


def _dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, options, **kwargs):
  if _narrow(lhs, rhs, preferred_element_type) is None:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  op = lambda a, b, result_dtype: lax.dot_general(
    a, b, dimension_numbers, precision, result_dtype, **kwargs
  )
  return op(lhs, rhs, None) if options is None else _product(op, options, lhs, rhs)


def dot_general(
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  dimension_numbers: lax.DotDimensionNumbers,
  precision: lax.PrecisionLike = None,
  preferred_element_type: Any = None,
  *,
  output_dtype: Any = None,
  rhs_grad_dtype: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """:func:`jax.lax.dot_general` for 16-bit operands, with fp32 results and gradients on request.

  For two float16 (or two bfloat16) operands and no wider
  ``preferred_element_type``, the product is JAX's 16-bit ``dot_general``,
  which every backend accumulates in fp32 (see the module docstring), with the
  options below. Anything else is passed to :func:`jax.lax.dot_general`
  unchanged.

  Args:
    lhs: the left operand, as for :func:`jax.lax.dot_general`.
    rhs: the right operand (a Flax layer's kernel).
    dimension_numbers: as for :func:`jax.lax.dot_general`.
    precision: as for :func:`jax.lax.dot_general`.
    preferred_element_type: as for :func:`jax.lax.dot_general`.
    output_dtype: ``None`` (a 16-bit result) or ``float32``: the result leaves
      the matmul in fp32, unrounded.
    rhs_grad_dtype: ``None`` or ``float32``: the gradient of ``rhs`` leaves its
      matmul in fp32 and is rounded to ``rhs``'s dtype afterwards.
    **kwargs: passed to :func:`jax.lax.dot_general` (e.g. ``out_sharding``).

  Returns:
    The product, in the operands' dtype (or ``output_dtype``).

  Example (a Flax layer built without editing its code path)::

    layer = nn.Dense(features=128, dot_general=jmp_lite.flax.dot_general)
  """
  options = _options(output_dtype, None, rhs_grad_dtype)
  return _dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, options, **kwargs)


def conv_general_dilated(
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  *args: Any,
  preferred_element_type: Any = None,
  output_dtype: Any = None,
  rhs_grad_dtype: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """:func:`jax.lax.conv_general_dilated` with :func:`dot_general`'s options.

  16-bit convolutions accumulate in fp32 on every backend without a
  declaration (JAX drops algorithm presets on convolutions), so without the
  options this is JAX's own convolution.

  Args:
    lhs: the input, as for :func:`jax.lax.conv_general_dilated`.
    rhs: the kernel.
    *args: :func:`jax.lax.conv_general_dilated`'s further positional
      arguments (``window_strides``, ``padding``...).
    preferred_element_type: as for :func:`jax.lax.conv_general_dilated`.
    output_dtype: ``None`` (a 16-bit result) or ``float32``: the result leaves
      the convolution in fp32, unrounded.
    rhs_grad_dtype: ``None`` or ``float32``: the kernel gradient leaves its
      convolution in fp32 and is rounded to ``rhs``'s dtype afterwards.
    **kwargs: passed to :func:`jax.lax.conv_general_dilated`.

  Returns:
    The convolution, in the operands' dtype (or ``output_dtype``).
  """
  dtype = _narrow(lhs, rhs, preferred_element_type)
  options = _options(output_dtype, None, rhs_grad_dtype)
  # *args are conv_general_dilated's positional arguments before preferred_element_type.
  op = lambda a, b, result_dtype: lax.conv_general_dilated(  # type: ignore[misc]
    a, b, *args, preferred_element_type=result_dtype, **kwargs
  )
  if dtype is None:
    return op(lhs, rhs, preferred_element_type)
  if options is None:
    return op(lhs, rhs, None)
  return _product(op, options, jnp.asarray(lhs), jnp.asarray(rhs))


def einsum(
  subscripts: str,
  /,
  *operands: Any,
  output_dtype: Any = None,
  rhs_grad_dtype: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """:func:`jax.numpy.einsum` whose contractions go through :func:`dot_general`.

  Args:
    subscripts: the einsum specification, as for :func:`jax.numpy.einsum`.
    *operands: the arrays; the last is a layer's kernel, as in
      ``einsum_op(subscripts, inputs, kernel)``.
    output_dtype: as for :func:`dot_general`.
    rhs_grad_dtype: ``None`` or ``float32``: widens the gradient of the last
      operand wherever :func:`jax.numpy.einsum` puts it in its contraction,
      and both gradients of a contraction where it cannot be told apart.
    **kwargs: passed to :func:`jax.numpy.einsum` (``precision``,
      ``preferred_element_type``...).

  Returns:
    The contraction, in the operands' dtype (or ``output_dtype``).

  Raises:
    TypeError: if ``_dot_general`` is passed (this function sets it).
  """
  if "_dot_general" in kwargs:
    raise TypeError("einsum already contracts with jmp_lite's dot_general; drop _dot_general.")
  if _options(output_dtype, None, rhs_grad_dtype) is None:
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)
  if output_dtype is not None:
    # einsum casts its result to preferred_element_type: ask for the wide one,
    # which the contraction below then produces itself.
    kwargs["preferred_element_type"] = output_dtype
  kernel = jax.ShapeDtypeStruct(np.shape(operands[-1]), jnp.result_type(operands[-1]))

  def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    if output_dtype is not None and preferred_element_type is not None:
      if np.dtype(preferred_element_type) == np.dtype(output_dtype):
        preferred_element_type = None
    # einsum may put the kernel on either side (it hands over a converted copy, so
    # it is recognized by its shape), or reshape it first: then both are widened.
    on_lhs, on_rhs = (
      _like(x, kernel) and not _like(y, kernel) for x, y in ((lhs, rhs), (rhs, lhs))
    )
    grads = [
      rhs_grad_dtype if here or not (on_lhs or on_rhs) else None for here in (on_lhs, on_rhs)
    ]
    options = _options(output_dtype, *grads)
    return _dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, options, **kw)

  return jnp.einsum(subscripts, *operands, _dot_general=dot, **kwargs)


def _like(x: Any, spec: jax.ShapeDtypeStruct) -> bool:
  return np.shape(x) == spec.shape and jnp.result_type(x) == spec.dtype
