r"""fp8 recipes: the one place that says how each tensor of an fp8 matmul is scaled (private).

A recipe is a frozen (hashable, jit-static) dataclass implementing
:class:`Fp8Recipe`. :func:`dot_general` (and so :func:`einsum`, ``linen_fp8``
and ``nnx_fp8``) asks the recipe for its state and hands it the checked call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, runtime_checkable

import jax

from jmp_lite import _validation
from jmp_lite._fp8_config import (
  E4M3,
  E5M2,
  FAST_ACCUMULATION,
  Fp8Config,
  as_fp8_dtype,
  check_margin,
)
from jmp_lite.fp8._block import BlockSpec, block_matmul
from jmp_lite.fp8._canonical import canonical_dot
from jmp_lite.fp8._matmul import DotCall, check_call, per_tensor_dot
from jmp_lite.fp8._mx import MxSpec, mx_matmul, native_matmul
from jmp_lite.fp8._rowwise import RowwiseSpec, rowwise_matmul
from jmp_lite.fp8._scaling import Fp8DotAmax, Fp8DotState, init_dot_state


@runtime_checkable
class Fp8Recipe(Protocol):
  """How an fp8 matmul scales its input, kernel and output gradient.

  Implementations are frozen dataclasses (hashable: they are static under
  ``jit``).
  """

  def init_state(self) -> Fp8DotState | None:
    """The state of one matmul, fresh.

    Returns:
      An :class:`Fp8DotState`, or ``None`` for a recipe that keeps none.
    """
    ...

  def dot_general(
    self, call: DotCall, state: Fp8DotState | None, amax: Fp8DotAmax | None
  ) -> jax.Array:
    """The matmul of a checked :class:`DotCall` with this recipe's scaling.

    Args:
      call: the operands, canonical dimension numbers, result dtype, the loss
        scale the gradients carry and the output sharding.
      state: what :meth:`init_state` made (or its update), or ``None``.
      amax: a zero probe for the observations, or ``None``.

    Returns:
      The product in ``call.out_dtype``.
    """
    ...


def _refuse_state(recipe: Any, state: Any, amax: Any) -> None:
  if state is not None or amax is not None:
    raise ValueError(
      f"{type(recipe).__name__} keeps no state: pass state=None and amax=None (got "
      f"{type(state).__name__} and {type(amax).__name__}); the amax-history state belongs to "
      "fp8.DelayedScaling."
    )


class _Stateless:
  """A recipe whose scales come from the tensors themselves: no state, no amax to observe."""

  def init_state(self) -> None:
    """A stateless recipe keeps no state.

    Returns:
      ``None``.
    """
    return None

  def dot_general(self, call: DotCall, state: Any, amax: Any) -> jax.Array:
    """The matmul of a call under this recipe.

    Args:
      call: the checked call.
      state: must be ``None``.
      amax: must be ``None`` (nothing to observe).

    Returns:
      The product.
    """
    _refuse_state(self, state, amax)
    return self._product(call)

  def _product(self, call: DotCall) -> jax.Array:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_Stateless):
  r"""Per-tensor current scaling: each tensor scaled by its own amax, just in time (default).

  .. math:: s_x = \frac{\max|x| \cdot 2^{\text{margin}}}{\text{fp8\_max}}, \qquad
    q(x) = \mathrm{fp8}(x / s_x)

  for the input and kernel in the forward pass and the output gradient in the
  backward pass. Nothing is remembered between steps, so the first step has
  only fp8 rounding error, and any loss scale (layer-wise included) composes:
  a gradient is scaled by its own amax, whatever factor it carries. Each
  quantization waits for a reduction over its tensor (the cost delayed
  scaling avoids).

  Attributes:
    fwd_dtype: format of the input and kernel (default ``float8_e4m3fn``).
    bwd_dtype: format of the output gradient (default ``float8_e5m2``).
    power_of_2: round each scale up to a power of two (the division by it is
      then exact, and the amax still fits).
    margin: extra headroom in powers of two (>= 0).
    fast_accumulation: as in :class:`Fp8Config`.

  >>> x, k = jnp.full((2, 3), 896.0), jnp.full((3, 2), 2.0**-20)
  >>> dot_general(x, k, (((1,), (0,)), ((), ())), config=CurrentScaling()).tolist()
  [[0.0025634765625, 0.0025634765625], [0.0025634765625, 0.0025634765625]]
  """

  fwd_dtype: Any = E4M3
  bwd_dtype: Any = E5M2
  power_of_2: bool = False
  margin: float = 0.0
  fast_accumulation: str = "none"

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    set_("fwd_dtype", as_fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    set_("bwd_dtype", as_fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    if not isinstance(self.power_of_2, bool):
      raise TypeError(f"power_of_2 must be a bool, got {self.power_of_2!r}.")
    set_("margin", check_margin(self.margin))
    set_(
      "fast_accumulation",
      _validation.check_choice(self.fast_accumulation, "fast_accumulation", FAST_ACCUMULATION),
    )

  def _product(self, call: DotCall) -> jax.Array:
    """The per-tensor matmul with every scale from its tensor's own amax."""
    return per_tensor_dot(call, None, None, self, current=True, power_of_2=self.power_of_2)


FIRST_STEPS = ("own_amax", "calibrated")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Fp8Config):
  r"""Per-tensor delayed scaling: scales from an amax history (:class:`Fp8Config`'s fields).

  The matmul reads the state's scales; :func:`update` folds each step's
  observations into it. A tensor whose state has no scale yet (0: fresh from
  :func:`init_dot_state`, its history has never seen a nonzero amax) is
  quantized with its own amax, as under :class:`CurrentScaling`, so the first
  step cannot flush or saturate silently; :func:`calibrate` sets the scales
  from a batch before that step instead. An :class:`Fp8Config` given as a
  recipe is this recipe.

  Attributes:
    first_step: ``"own_amax"`` (default): a tensor without a scale yet is
      quantized with its own amax, a select in every step. ``"calibrated"``:
      the state is calibrated (:func:`calibrate`) before the first step and
      its scales are used as they are, with no select; a tensor still without
      a scale (uncalibrated, or all zero when calibrated) makes the step's
      products NaN, never zero.
  """

  first_step: str = "own_amax"

  def __post_init__(self):
    super().__post_init__()
    _validation.check_choice(self.first_step, "first_step", FIRST_STEPS)

  def init_state(self) -> Fp8DotState:
    """A fresh state.

    Returns:
      An :class:`Fp8DotState` with scales 0 (none yet) and all-zero histories.
    """
    return init_dot_state(self)

  def dot_general(self, call: DotCall, state: Any, amax: Any) -> jax.Array:
    """The per-tensor matmul with the state's scales.

    Args:
      call: the checked call.
      state: this matmul's :class:`Fp8DotState`.
      amax: a zero probe, or ``None``.

    Returns:
      The product.
    """
    trust = self.first_step == "calibrated"
    return per_tensor_dot(call, state, amax, self, current=False, trust_state=trust)


WEIGHT_GRADS = ("fp8", "compute_dtype")


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(_Stateless):
  r"""Row-wise scaling: one power-of-two scale per row of each operand along its contraction.

  .. math:: s_x[m] = 2^{\lceil \log_2(\max_k |x_{mk}| / \text{fp8\_max}) \rceil}, \qquad
    y_{mn} = \Big(\sum_k q(x)_{mk}\, q(w)_{kn}\Big)_{\text{fp32}} s_x[m]\, s_w[n]

  (torchao's ``ROWWISE``). A row's outlier only costs that row precision. The backward pass
  quantizes again along each product's own contraction (the output axis for the input
  gradient, the tokens for the weight gradient), from the high-precision operands, which are
  the residuals. Scales come from the tensors themselves: no state, and any loss scale.

  Attributes:
    fwd_dtype: format of the input and kernel (default ``float8_e4m3fn``).
    bwd_dtype: format of the output gradient (default ``float8_e4m3fn``, as torchao).
    weight_grad: ``"fp8"`` (default), or ``"compute_dtype"``: the weight gradient
      :math:`x^\top g` in the operands' dtype, summed in fp32 (torchao's
      ``ROWWISE_WITH_GW_HP``).
    fast_accumulation: as in :class:`Fp8Config`.
  """

  fwd_dtype: Any = E4M3
  bwd_dtype: Any = E4M3
  weight_grad: str = "fp8"
  fast_accumulation: str = "none"

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    set_("fwd_dtype", as_fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    set_("bwd_dtype", as_fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    set_("weight_grad", _validation.check_choice(self.weight_grad, "weight_grad", WEIGHT_GRADS))
    set_(
      "fast_accumulation",
      _validation.check_choice(self.fast_accumulation, "fast_accumulation", FAST_ACCUMULATION),
    )

  def _product(self, call: DotCall) -> jax.Array:
    """The row-wise matmul of a call."""
    fast = self.fast_accumulation != "none"
    precision = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
    spec = RowwiseSpec(self.fwd_dtype, self.bwd_dtype, self.weight_grad == "fp8", precision)
    return canonical_dot(call, lambda a, b, results: rowwise_matmul(a, b, spec, results))


@dataclasses.dataclass(frozen=True)
class BlockScaling(_Stateless):
  r"""Block scaling as DeepSeek-V3 trains: fp32 scales per tile, fp32 sums every 128 of K.

  The input and the output gradient get one scale per 1 x 128 tile (one row, 128 elements of
  the contraction), the kernel one per 128 x 128 block; each scale is its tile's amax over
  E4M3's largest value, in fp32, and every tensor is E4M3. The matmul sums each 128-element
  chunk of K in fp8 with an fp32 result and adds the chunks, scaled, in fp32:

  .. math:: y_{mn} = \sum_c \Big(\sum_{k \in c} q(x)_{mk}\, q(w)_{kn}\Big)_{\text{fp32}}
    s_x[m, c]\; s_w[c, \lfloor n/128 \rfloor]

  The input gradient reuses the kernel's blocks (transposed); the weight gradient quantizes
  the input and the output gradient in tiles along the tokens. K, M and N that are not
  multiples of 128 are padded with zeros. No state; any loss scale.

  Attributes:
    dtype: the format of every tensor (default ``float8_e4m3fn``).
  """

  dtype: Any = E4M3

  def __post_init__(self):
    object.__setattr__(self, "dtype", as_fp8_dtype(self.dtype, "dtype"))

  def _product(self, call: DotCall) -> jax.Array:
    """The block-scaled matmul of a call."""
    spec = BlockSpec(self.dtype, jax.lax.Precision.HIGHEST)
    return canonical_dot(call, lambda a, b, results: block_matmul(a, b, spec, results))


MX_IMPLEMENTATIONS = ("emulated", "scaled_dot_general")


@dataclasses.dataclass(frozen=True)
class Mxfp8Scaling(_Stateless):
  r"""MXFP8: one E8M0 (power-of-two) scale per 32 elements of each operand's contraction.

  .. math:: s = 2^{\lceil \log_2(\max_{\text{block}} |x| / \text{fp8\_max}) \rceil}

  rounded up, so a block's amax always fits (arXiv 2506.08027 found rounding up necessary;
  the OCP spec's conversion rounds down). Every product, the two gradients included, blocks
  its operands along its own contraction; the forward pass saves the input and the kernel in
  fp8, blocked along the gradients' contractions. No state; any loss scale.

  Attributes:
    fwd_dtype: format of the input and kernel (default ``float8_e4m3fn``).
    bwd_dtype: format of the output gradient (default ``float8_e4m3fn``).
    implementation: ``"emulated"`` (default: quantize, dequantize, an fp32 matmul; the same
      numerics everywhere) or ``"scaled_dot_general"`` (``jax.nn.scaled_dot_general``, where
      the installed JAX compiles MXFP8: see :func:`mxfp8_native_support`; a
      ``NotImplementedError`` saying why otherwise). The native path uses JAX's own
      quantization and formats.
  """

  fwd_dtype: Any = E4M3
  bwd_dtype: Any = E4M3
  implementation: str = "emulated"

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    set_("fwd_dtype", as_fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    set_("bwd_dtype", as_fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    set_(
      "implementation",
      _validation.check_choice(self.implementation, "implementation", MX_IMPLEMENTATIONS),
    )

  def _product(self, call: DotCall) -> jax.Array:
    """The MXFP8 matmul of a call."""
    if self.implementation == "scaled_dot_general":
      return canonical_dot(call, lambda a, b, results: native_matmul(a, b, results.out_dtype))
    spec = MxSpec(self.fwd_dtype, self.bwd_dtype)
    return canonical_dot(call, lambda a, b, results: mx_matmul(a, b, spec, results))


def as_recipe(recipe: Any) -> Any:
  """``recipe`` as an :class:`Fp8Recipe`.

  Args:
    recipe: a recipe; ``None`` is :class:`CurrentScaling`, an :class:`Fp8Config`
      is :class:`DelayedScaling` with its fields.

  Returns:
    The recipe.

  Raises:
    TypeError: naming ``recipe`` if it is none of these.
  """
  if recipe is None:
    return CurrentScaling()
  if type(recipe) is Fp8Config:
    return DelayedScaling(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)})
  return _validation.check_type(
    recipe,
    Fp8Recipe,
    "config must be an fp8 recipe (fp8.CurrentScaling, fp8.DelayedScaling, an Fp8Config, or "
    "an object implementing fp8.Fp8Recipe)",
  )


def dot_general(
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  dimension_numbers: Any,
  state: Fp8DotState | None = None,
  amax: Fp8DotAmax | None = None,
  *,
  config: Any = None,
  loss_scale: Any = None,
  precision: Any = None,
  preferred_element_type: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  r"""``lax.dot_general`` with fp8 operands, scaled as the recipe ``config`` says.

  .. math::

    y = \big(q(x) \cdot q(k)\big)_{\text{fp32}} \; s_x s_k, \qquad
    \partial x = \big(q(g) \cdot q(k)^\top\big)_{\text{fp32}} \; s_g s_k, \qquad
    \partial k = \big(q(x)^\top \cdot q(g)\big)_{\text{fp32}} \; s_x s_g

  ``lhs`` (:math:`x`, the input) and ``rhs`` (:math:`k`, the kernel) are
  quantized to ``config.fwd_dtype``, the output gradient :math:`g` to
  ``config.bwd_dtype``. With :class:`CurrentScaling` (the default) each scale
  comes from its tensor's own amax; with :class:`DelayedScaling` (or an
  :class:`Fp8Config`) from ``state``, which is read, never written (and a
  trace under :func:`current_scaling` uses the tensors' own amaxes instead).

  Args:
    lhs: the input, a floating array in 16 or 32 bits.
    rhs: the kernel, a floating array in 16 or 32 bits.
    dimension_numbers: as in :func:`jax.lax.dot_general`.
    state: this matmul's :class:`Fp8DotState` (delayed scaling), or ``None``.
    amax: a zero :class:`Fp8DotAmax` probe (delayed scaling); differentiate
      with respect to it to receive this step's observed amaxes. ``None``
      observes nothing (eval).
    config: the recipe (:class:`Fp8Recipe`); by default ``CurrentScaling()``,
      or ``DelayedScaling()`` when a ``state`` is given.
    loss_scale: the loss scale the gradients carry (a number, array, or
      jmp_lite loss scale; default 1). Delayed scaling quantizes the output
      gradient with ``state.output_grad.scale * loss_scale`` and records its
      amax divided by it, so fp8 scaling and loss scaling compose exactly;
      current scaling needs no loss scale and takes any.
    precision: accepted for signature compatibility with ``lax.dot_general``
      (Flax passes it) and ignored: products of fp8 values are exact in fp32,
      and ``config.fast_accumulation`` decides how the GPU sums them.
    preferred_element_type: output dtype (default: the promoted operand
      dtype). Accumulation is fp32 regardless (see ``fast_accumulation``).
    out_sharding: passed to the forward ``lax.dot_general``.

  Returns:
    The product, with gradients flowing to ``lhs`` and ``rhs`` (in their
    dtypes) and the observations to ``amax``.

  >>> x, k = jnp.full((2, 3), 0.5), jnp.full((3, 2), 3.0)
  >>> dot_general(x, k, (((1,), (0,)), ((), ())), config=CurrentScaling(power_of_2=True)).tolist()
  [[4.5, 4.5], [4.5, 4.5]]
  """
  del precision
  # A state asks for the recipe that reads one.
  recipe = DelayedScaling() if config is None and state is not None else as_recipe(config)
  call = check_call(lhs, rhs, dimension_numbers, preferred_element_type, loss_scale, out_sharding)
  return recipe.dot_general(call, state, amax)
