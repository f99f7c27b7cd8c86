r"""Where fp8 runs: which matmul layers, by path, class, position and shape (private).

An :class:`Fp8Placement` decides, for each matmul layer ``linen_fp8``/``nnx_fp8``
would run in fp8, whether it does; the recipe (:class:`Fp8Recipe`) says how.
The decision is made while the model is traced, so it is static: no retrace,
no host sync. A layer is kept in its compute dtype, for the first reason that
applies:

1. no ``include`` pattern matches it (when there are some);
2. an ``exclude`` pattern matches it;
3. it is the model's first or last matmul layer (``keep_first_last``);
4. its matmul is too small for fp8 to pay (``shape_rule``, from its M, K, N).

The shape rule's default, :class:`MatmulRoofline`, estimates one training step
of the matmul (three GEMMs) both ways on an H200 and runs fp8 where it is
faster:

.. math::

  t_{16} = \sum_{g} \max\Big(\frac{2MKN}{F_{16}}, \frac{B^{16}_g}{W}\Big), \qquad
  t_{8} = \sum_{g} \max\Big(\frac{2MKN}{F_{8}}, \frac{B^{8}_g}{W}\Big)
    + \frac{q\,(MK + KN + MN)}{W}

over the forward GEMM and the two gradient GEMMs :math:`g`, where
:math:`B_g` are the bytes a GEMM reads and writes (2 per 16-bit element, 1 per
fp8 operand element, 2 per element of its 16-bit result) and :math:`q` the
bytes moved per element to quantize an operand (:math:`x`, the kernel and the
output gradient, once each). Quantizing is memory-bound, so fp8 pays only
where the GEMM time it halves exceeds the traffic it adds: for square
matmuls from :math:`M = K = N = 1442` (H200 numbers).

>>> rule = MatmulRoofline()
>>> rule.should_run(1024, 2048, 1024), rule.should_run(4096, 8192, 16384)
(False, True)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from jmp_lite import _validation


@runtime_checkable
class ShapeRule(Protocol):
  """Which matmuls, by size, run in fp8: ``should_run(m, k, n)``."""

  def should_run(self, m: int, k: int, n: int) -> bool:
    """Whether a matmul of an ``[m, k]`` input and a ``[k, n]`` kernel runs in fp8.

    Args:
      m: the rows of the input (tokens; batch axes folded in).
      k: the contraction.
      n: the kernel's output features.

    Returns:
      True to run it in fp8.
    """
    ...


def _positive(value: Any, name: str) -> float:
  real = _validation.as_real(value, name, "a positive number")
  if not (real > 0 and math.isfinite(real)):
    raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
  return real


@dataclasses.dataclass(frozen=True)
class MatmulRoofline:
  r"""Runs a matmul in fp8 where a roofline estimate of its training step says fp8 is faster.

  The estimate is the module's formula: each of the three GEMMs of a step
  (forward, input gradient, weight gradient) takes the longer of its flops at
  the peak rate and its bytes at the memory bandwidth, and fp8 adds the
  quantization of its three operands, ``quantize_bytes`` per element. It is an
  ideal bound (peak rates, no launch overhead): where it says fp8 loses, fp8
  loses; where it says fp8 wins, a real step may still not (torchao reports
  0.80x at ``M, K, N = 1024, 2048, 1024`` and 1.39x at ``4096, 8192, 16384``;
  this estimate gives 0.92x and 1.66x).

  Attributes:
    peak_flops_16bit: dense bf16 tensor-core peak (default 989e12: H100/H200
      SXM, NVIDIA's datasheets).
    peak_flops_fp8: dense fp8 tensor-core peak (default 1979e12, the same).
    memory_bandwidth: bytes per second (default 4.8e12: H200's HBM3e; H100
      SXM has 3.35e12).
    quantize_bytes: bytes moved per element to quantize one 16-bit operand
      (default 7: the amax pass reads 2, the cast reads 2 and writes 1, the
      transposed fp8 copy a GEMM of the backward pass needs reads 1 and
      writes 1).
  """

  peak_flops_16bit: float = 989e12
  peak_flops_fp8: float = 1979e12
  memory_bandwidth: float = 4.8e12
  quantize_bytes: float = 7.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      object.__setattr__(self, f.name, _positive(getattr(self, f.name), f.name))

  def step_time(self, m: int, k: int, n: int, *, fp8: bool) -> float:
    """The estimated seconds of the matmul's forward and backward GEMMs.

    Args:
      m, k, n: the matmul's shape, as :meth:`ShapeRule.should_run` takes it.
      fp8: estimate the fp8 step (quantization included) instead of the 16-bit one.

    Returns:
      The estimate in seconds.
    """
    flops = 2.0 * m * k * n / (self.peak_flops_fp8 if fp8 else self.peak_flops_16bit)
    mk, kn, mn = m * k, k * n, m * n
    # Each GEMM: its two operands, then its 16-bit result.
    gemms = ((mk, kn, mn), (mn, kn, mk), (mk, mn, kn))
    operand_bytes = 1.0 if fp8 else 2.0
    total = sum(
      max(flops, (operand_bytes * (a + b) + 2.0 * out) / self.memory_bandwidth)
      for a, b, out in gemms
    )
    if fp8:
      total += self.quantize_bytes * (mk + kn + mn) / self.memory_bandwidth
    return total

  def speedup(self, m: int, k: int, n: int) -> float:
    """The estimated 16-bit step time over the fp8 one (> 1: fp8 is faster).

    Args:
      m, k, n: the matmul's shape, as :meth:`ShapeRule.should_run` takes it.

    Returns:
      The ratio.
    """
    return self.step_time(m, k, n, fp8=False) / self.step_time(m, k, n, fp8=True)

  def should_run(self, m: int, k: int, n: int) -> bool:
    """Whether fp8 is estimated faster for this matmul.

    Args:
      m, k, n: the matmul's shape, as :meth:`ShapeRule.should_run` takes it.

    Returns:
      ``speedup(m, k, n) > 1``.
    """
    return self.speedup(m, k, n) > 1.0


def _pattern(value: Any, name: str) -> str | type:
  if isinstance(value, type):
    return value
  _validation.check_type(
    value, str, f"{name} takes regular expressions (str) on the module path and module classes"
  )
  try:
    re.compile(value)
  except re.error as e:
    raise ValueError(f"{name} pattern {value!r} is not a regular expression: {e}.") from None
  return value


def _patterns(value: Any, name: str) -> tuple[str | type, ...]:
  if isinstance(value, (str, type)):
    value = (value,)
  _validation.check_type(
    value, Sequence, f"{name} must be a regular expression, a module class or a sequence of them"
  )
  return tuple(_pattern(v, name) for v in value)


def pattern_matches(pattern: str | type, path: str, classes: tuple[type, ...]) -> bool:
  """Whether a placement pattern matches a layer.

  Args:
    pattern: a regular expression (searched in ``path``) or a class (matched
      by ``issubclass`` against ``classes``).
    path: the layer's module path, names joined by ``"/"``.
    classes: the classes of the layer and of the modules it is called inside.

  Returns:
    Whether it matches.
  """
  if isinstance(pattern, type):
    return any(issubclass(c, pattern) for c in classes)
  return re.search(pattern, path) is not None  # re keeps the compiled patterns itself


def describe_pattern(pattern: str | type) -> str:
  """A pattern as the messages name it: ``'regex'`` or the class's name."""
  return pattern.__name__ if isinstance(pattern, type) else repr(pattern)


@dataclasses.dataclass(frozen=True)
class Fp8Placement:
  r"""Which matmul layers ``linen_fp8`` and ``nnx_fp8`` run in fp8.

  A layer runs in fp8 unless, in this order: ``include`` is given and none of
  its patterns matches the layer; a pattern of ``exclude`` matches it; it is
  the first or last matmul layer and ``keep_first_last`` is set; or
  ``shape_rule.should_run(m, k, n)`` is false for its matmul. A pattern is a
  regular expression, searched (``re.search``) in the layer's module path
  (names joined by ``"/"``: ``"blocks_0/mlp/Dense_1"``, ``"blocks/0/mlp/up"``
  in NNX), or a module class, which matches the layers that are, or are
  called inside, an instance of it (``exclude=(nn.MultiHeadDotProductAttention,)``).
  A pattern that matches no layer of the model is an error.

  *First and last* are found from the order the model calls its matmul
  layers in: the first is the first layer called and every layer called with
  the same input array (an MLP's input layer; a transformer's first query,
  key and value projections; embeddings are lookups, not matmuls), the last
  is the last layer called and every layer called with its input (the
  logits head, or the heads reading the trunk's output). A layer called in
  several places (a scanned body, a shared block) is one layer.

  Attributes:
    include: patterns; if given, only the layers matching one run in fp8.
    exclude: patterns; the layers matching one stay in the compute dtype.
    keep_first_last: keep the first and last matmul layers in the compute
      dtype (default True, as DeepSeek-V3 and Transformer Engine's recipes do).
    shape_rule: a :class:`ShapeRule` (default :class:`MatmulRoofline`, an H200
      estimate), or ``None`` to run matmuls of every size in fp8.

  >>> Fp8Placement(exclude="head").reason("lm/head", (), None)
  "excluded by 'head'"
  """

  include: Any = ()
  exclude: Any = ()
  keep_first_last: bool = True
  shape_rule: Any = MatmulRoofline()

  def __post_init__(self):
    object.__setattr__(self, "include", _patterns(self.include, "include"))
    object.__setattr__(self, "exclude", _patterns(self.exclude, "exclude"))
    _validation.check_bool(self.keep_first_last, "keep_first_last")
    if self.shape_rule is not None:
      _validation.check_type(
        self.shape_rule,
        ShapeRule,
        "shape_rule must be None or have a should_run(m, k, n) method (fp8.MatmulRoofline, "
        "fp8.ShapeRule)",
      )

  @property
  def patterns(self) -> tuple[str | type, ...]:
    """Every pattern, ``include``'s then ``exclude``'s."""
    return (*self.include, *self.exclude)

  def reason(self, path: str, classes: tuple[type, ...], position: str | None) -> str | None:
    """Why a layer stays in the compute dtype, before its shape is known (``None``: fp8).

    Args:
      path: the layer's module path, names joined by ``"/"``.
      classes: the classes of the layer and of the modules it is called inside.
      position: ``"first"``, ``"last"`` or ``None``.

    Returns:
      The reason, or ``None``.
    """
    if self.include and not any(pattern_matches(p, path, classes) for p in self.include):
      return "matched by no include pattern"
    for p in self.exclude:
      if pattern_matches(p, path, classes):
        return f"excluded by {describe_pattern(p)}"
    if self.keep_first_last and position is not None:
      return f"the {position} matmul layer (keep_first_last)"
    return None

  def shape_reason(self, m: int, k: int, n: int) -> str | None:
    """Why a matmul of this size stays in the compute dtype (``None``: fp8).

    Args:
      m, k, n: the matmul's shape, as :meth:`ShapeRule.should_run` takes it.

    Returns:
      The reason, or ``None``.
    """
    if self.shape_rule is None or self.shape_rule.should_run(m, k, n):
      return None
    return f"M, K, N = {m}, {k}, {n}: too small to pay (shape_rule)"


ALL_LAYERS = Fp8Placement(keep_first_last=False, shape_rule=None)


def as_placement(placement: Any) -> Fp8Placement:
  """``placement`` as an :class:`Fp8Placement` (``None``: the default one).

  Args:
    placement: an :class:`Fp8Placement` or ``None``.

  Returns:
    The placement.

  Raises:
    TypeError: naming ``placement`` otherwise.
  """
  if placement is None:
    return Fp8Placement()
  return _validation.check_type(
    placement,
    Fp8Placement,
    "placement must be an fp8.Fp8Placement (e.g. fp8.Fp8Placement(exclude='head'), "
    "fp8.ALL_LAYERS) or None",
  )


def positions(calls: Sequence[tuple[str, Any]]) -> dict[str, str]:
  """The first and last matmul layers, from the layers called in one run of a model.

  Args:
    calls: ``(path, input)`` of each layer call, in the order called (a layer
      may repeat); ``input`` is the array the layer was called with.

  Returns:
    ``{path: "first" | "last"}``: the first layer called and every layer
    called with the same input (by identity: a transformer's key and value
    projections with its query), then likewise the last (every head reading
    the trunk's output); ``"first"`` wins for a layer that is both.
  """
  found: dict[str, str] = {}
  if not calls:
    return found
  for position, (_, reference) in (("last", calls[-1]), ("first", calls[0])):
    for path, x in calls:
      if x is reference:
        found[path] = position
  return found


def matmul_dims(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dims: Any) -> tuple:
  """The ``(m, k, n)`` of a ``dot_general``: batch axes folded into ``m``.

  Args:
    lhs_shape: the input's shape.
    rhs_shape: the kernel's shape.
    dims: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.

  Returns:
    ``(m, k, n)``: the product of the input's free and batch axes, of the
    contracting axes, and of the kernel's free axes.
  """
  (lc, rc), (_, rb) = dims
  k = math.prod(lhs_shape[i] for i in lc)
  m = math.prod(s for i, s in enumerate(lhs_shape) if i not in lc)
  n = math.prod(s for i, s in enumerate(rhs_shape) if i not in rc and i not in rb)
  return int(m), int(k), int(n)
