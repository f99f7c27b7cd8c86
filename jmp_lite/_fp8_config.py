"""fp8 configuration: the formats of fp8 matmuls and how their scales adapt (private).

This module sits below the policy module (imports flow ``_dtypes`` ->
``_fp8_config`` -> ``_policy`` -> ... -> ``fp8``): the fp8 package's recipes
(delayed scaling is an :class:`Fp8Config`) and fp8 policies build on both. It
imports nothing of jmp_lite but dtypes and validation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32 = np.dtype(jnp.float32)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FAST_ACCUMULATION = ("none", "forward", "all")


def as_fp8_dtype(value: Any, name: str) -> np.dtype:
  """Parses a dtype and checks that it is one of the fp8 formats in ``FORMATS``.

  Args:
    value: a dtype name or dtype-like object.
    name: what ``value`` is, for the error message.

  Returns:
    The ``np.dtype``.

  Raises:
    TypeError, ValueError: naming ``value`` if it is not a dtype, or not an fp8
      format jmp_lite knows.
  """
  supported = ", ".join(d.name for d in dtypes.FLOAT8_DTYPES)
  known_fp8 = lambda d: dtypes.is_float8(d) and d.name in dtypes.FORMATS
  return _validation.check_dtype(value, name, known_fp8, f"an fp8 format ({supported})")


def check_margin(value: Any) -> float:
  """Returns ``value`` as a float if it is a finite number in [0, 64), else raises naming it."""
  margin = _validation.as_real(value, "margin", "a finite number >= 0")
  # 2**margin must stay a finite fp32 factor; margins used in practice are 0-4.
  if not (math.isfinite(margin) and 0 <= margin < 64):
    raise ValueError(f"margin must be finite, >= 0 and < 64, got {value!r}.")
  return margin


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  r"""How fp8 matmuls quantize and how their scales adapt (hashable, jit-static).

  After a step that observed the absolute maximum :math:`a_t` of a tensor, its
  amax history :math:`h` (length :math:`L`) and scale :math:`s` become

  .. math::

    h \leftarrow (a_t, h_0, \dots, h_{L-2}), \qquad
    A = \begin{cases} \max_i h_i & \texttt{"max"} \\ h_0 & \texttt{"most_recent"}\end{cases},
    \qquad s \leftarrow \frac{A \cdot 2^{\text{margin}}}{\text{fp8\_max}}

  (see :func:`jmp_lite.fp8.update_scale` for the cases that keep the scale).

  Attributes:
    fwd_dtype: format of the inputs and kernels in the forward pass (default
      ``float8_e4m3fn``: 3 mantissa bits, max 448).
    bwd_dtype: format of the output gradient in the backward pass (default
      ``float8_e5m2``: 2 mantissa bits, max 57344). E4M3 forward with E5M2
      backward is Transformer Engine's "hybrid" recipe.
    amax_history_length: :math:`L`, how many steps of amax each tensor
      remembers (>= 1, default 1024).
    amax_compute_algo: ``"max"`` (default) takes the largest amax in the
      history (robust to a tensor whose range shrinks for a step),
      ``"most_recent"`` the last one (adapts fastest).
    margin: extra headroom in powers of two (default 0): the scale maps
      :math:`A \cdot 2^{\text{margin}}` to the format's largest value.
    fast_accumulation: which matmuls may use the GPU's fast fp8 accumulation,
      which keeps fewer bits of the running sum than fp32: ``"none"``
      (default: every sum in fp32), ``"forward"`` (the forward matmul only) or
      ``"all"``. It sets the matmuls' ``precision`` (``DEFAULT`` for fast,
      ``HIGHEST`` otherwise), which XLA:GPU reads; XLA:CPU sums in fp32 either
      way.

  Raises:
    TypeError, ValueError: naming the field and the value given, for a
      non-fp8 format, a history length below 1, an unknown rule, or a margin
      that is negative, non-finite or 64 and above.

  >>> Fp8Config(amax_history_length=16).fwd_dtype.name
  'float8_e4m3fn'
  """

  fwd_dtype: dtypes.DTypeLike = E4M3
  bwd_dtype: dtypes.DTypeLike = E5M2
  amax_history_length: int = 1024
  amax_compute_algo: str = "max"
  margin: float = 0.0
  fast_accumulation: str = "none"

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    choice = _validation.check_choice
    set_("fwd_dtype", as_fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    set_("bwd_dtype", as_fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    set_(
      "amax_history_length",
      _validation.check_int(self.amax_history_length, "amax_history_length", 1),
    )
    set_(
      "amax_compute_algo", choice(self.amax_compute_algo, "amax_compute_algo", AMAX_COMPUTE_ALGOS)
    )
    set_("margin", check_margin(self.margin))
    set_(
      "fast_accumulation", choice(self.fast_accumulation, "fast_accumulation", FAST_ACCUMULATION)
    )


def as_config(config: Fp8Config | None) -> Fp8Config:
  """``config``, or ``Fp8Config()`` for ``None``; a TypeError naming anything else."""
  if config is None:
    return Fp8Config()
  if not isinstance(config, Fp8Config):
    raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}.")
  return config
