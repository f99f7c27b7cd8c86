"""How a 16-bit matmul states fp32 accumulation, per platform (see ``jmp_lite.flax.dot_general``).

Shared by the 16-bit kernels of :mod:`jmp_lite.flax` and :func:`jmp_lite.autocast`, which
rewrites a program's matmuls to 16-bit operands the same way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _compat

# The presets declared, by platform: none on XLA:GPU, which honours them but then emits every
# declared dot as a Triton gemm, never cuBLAS; none on XLA:CPU, which rejects them for fp16 and
# for single-element dots (and accumulates in fp32 anyway).
DECLARED = {"tpu": {np.dtype(jnp.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32}}


def is_16bit_float(dtype: Any) -> bool:
  """Whether ``dtype`` is float16 or bfloat16."""
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize == 2


def declared_precision(
  dtype: Any, lhs_shape: tuple, rhs_shape: tuple, dimension_numbers: Any, platform: str
) -> lax.DotAlgorithmPreset | None:
  """The algorithm preset stating fp32 accumulation of a 16-bit matmul, if declared.

  Args:
    dtype: the operands' dtype.
    lhs_shape: the left operand's shape.
    rhs_shape: the right operand's shape.
    dimension_numbers: the ``dot_general`` dimension numbers.
    platform: the platform the program is traced for (``"cpu"``, ``"gpu"``, ``"tpu"``).

  Returns:
    The preset, or ``None`` where nothing is declared (XLA:CPU, XLA:GPU; fp16 on
    TPU) or for a product that is not a matrix product (an operand without a
    free dimension, or a single output element: compilers lower those as
    reductions).
  """
  preset = DECLARED.get(platform, {}).get(np.dtype(dtype))
  if preset is None:
    return None
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers

  def free(shape, contract, batch):
    return [n for d, n in enumerate(shape) if d not in (*contract, *batch)]

  lhs_free = free(lhs_shape, lhs_contract, lhs_batch)
  rhs_free = free(rhs_shape, rhs_contract, rhs_batch)
  if not lhs_free or not rhs_free or int(np.prod(lhs_free + rhs_free)) < 2:
    return None
  return preset


def bind_wide(primitive: Any, params: dict, wide: np.dtype, lhs: Any, rhs: Any) -> jax.Array:
  """Binds a 16-bit product with a ``wide`` result, in a form every backend runs.

  XLA:CPU keeps a bf16 x bf16 -> fp32 matmul on bf16 operands when its dot
  library (YNNPACK) takes it, and only later folds a transpose of the result
  into the dot (operands swapped: the lhs contracted on dimension 0, the rhs
  on dimension 1). That happens to the kernel gradient of a layer applied to
  [batch, length, features] inputs, which JAX computes transposed. The
  library refuses that form and XLA:CPU's generic dot has no such kernel:
  the program compiles, then fails ("Unsupported element type for DotThunk:
  BF16 x BF16 = F32"). So on CPU the operands are widened first, exactly:
  the same products, summed in fp32 (as XLA:CPU computes 16-bit matmuls
  anyway). Other platforms keep the 16-bit operands; the branch is picked
  when the program is lowered, so theirs holds no trace of the CPU one.

  Args:
    primitive: ``dot_general_p`` or ``conv_general_dilated_p``.
    params: its parameters, as in a jaxpr equation.
    wide: the result dtype.
    lhs: the left 16-bit operand.
    rhs: the right 16-bit operand.

  Returns:
    The product in ``wide``.
  """
  params = dict(params, preferred_element_type=wide)
  narrow = lambda a, b: _compat.bind(primitive, params, a, b)[0]
  # precision=None: an fp32 CPU product has nothing to declare (a TPU preset names 16-bit operands).
  widened = lambda a, b: _compat.bind(
    primitive, dict(params, precision=None), a.astype(wide), b.astype(wide)
  )[0]
  return lax.platform_dependent(lhs, rhs, cpu=widened, default=narrow)
