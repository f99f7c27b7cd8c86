"""16-bit products with a wide result, in a form every backend runs.

Shared by the 16-bit kernels of :mod:`jmp_lite.flax` and :func:`jmp_lite.autocast`, which
rewrites a program's matmuls to 16-bit operands the same way. Nothing here declares an
algorithm preset: every backend measured accumulates 16-bit products in fp32 without one
(XLA:TPU compiles ``BF16_BF16_F32`` to the program it compiles without it;
``tests/test_deviceless_benchmark.py``), and XLA:GPU, which honours a preset, then emits every
declared dot as a Triton gemm and never cuBLAS.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _compat


def is_16bit_float(dtype: Any) -> bool:
  """Whether ``dtype`` is float16 or bfloat16."""
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize == 2


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
  # precision=None: a preset the caller passed names 16-bit operands, and these are fp32.
  widened = lambda a, b: _compat.bind(
    primitive, dict(params, precision=None), a.astype(wide), b.astype(wide)
  )[0]
  return lax.platform_dependent(lhs, rhs, cpu=widened, default=narrow)
