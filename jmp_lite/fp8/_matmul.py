"""The fp8 matmul: ``dot_general`` with per-tensor scaling and a custom VJP (private).

The GEMM form
-------------
Each matmul takes the fp8 arrays themselves as operands, with an fp32 result
that is multiplied by the product of the scales and then cast::

  dot(q_a, q_b) -> f32, * broadcast(s_a * s_b), convert

XLA:GPU turns this into one cuBLASLt fp8 GEMM with the scale applied to the
fp32 sum. The other form its GEMM rewriter knows, dequantized operands
``dot(convert(q_a) * s_a, convert(q_b) * s_b)``, is not safe to emit from JAX:
XLA:GPU's conversion simplification removes the ``bf16 -> fp8 -> bf16`` round
trip of the quantization, and the "fp8" matmul runs as a plain bf16 GEMM on
unquantized values (``docs/fp8.md``, "The GEMM form"). fp8 x fp8 products are
exact in fp32, so the sum is exact up to fp32 rounding whatever the form.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite._fp8_config import F32
from jmp_lite._loss_scale import gradient_scale_value
from jmp_lite.fp8 import _current_scaling, _sharding
from jmp_lite.fp8._quantize import compute_amax, quantize
from jmp_lite.fp8._scaling import Fp8DotAmax, Fp8DotState, compute_scale


def _canonical_dimension_numbers(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int):
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(i) for i in d) for d in (lc, rc, lb, rb))
  except (TypeError, ValueError) as e:
    raise ValueError(
      "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
      f"got {dimension_numbers!r}."
    ) from e
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"Mismatched contracting or batch dimensions in {dimension_numbers!r}.")
  for dims, ndim, side in ((lc + lb, lhs_ndim, "lhs"), (rc + rb, rhs_ndim, "rhs")):
    if len(set(dims)) != len(dims) or any(not 0 <= d < ndim for d in dims):
      raise ValueError(
        f"Invalid {side} dimensions {dims} for an operand of rank {ndim} in "
        f"dimension_numbers {dimension_numbers!r}."
      )
  return (lc, rc), (lb, rb)


def _free_axes(ndim: int, contracting: tuple[int, ...], batch: tuple[int, ...]):
  return tuple(i for i in range(ndim) if i not in contracting and i not in batch)


def _scaled_dot(a, b, dims, out_dtype, precision, out_sharding=None) -> jax.Array:
  """``(q_a s_a) . (q_b s_b)`` in ``out_dtype`` from ``a = (q_a, s_a)``, ``b = (q_b, s_b)``.

  fp8 operands, an fp32 sum scaled once and rounded once to ``out_dtype``.
  """
  (q_a, s_a), (q_b, s_b) = a, b
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  out = lax.dot_general(q_a, q_b, dims, precision, preferred_element_type=F32, **kwargs)
  return (out * (s_a * s_b)).astype(out_dtype)


def _operand_cotangent(g, operand, other, dims, operand_is_lhs, out_dtype, precision):
  """Transpose of ``operand -> dot_general`` (the other operand fixed), applied to g.

  ``g``, ``operand`` and ``other`` are ``(fp8 values, scale)`` pairs. g's axes
  are [batch, lhs free, rhs free]. Contracting g's axes that belong to
  ``other`` with ``other``'s free axes leaves the batch axes, the operand's
  free axes and its contracting axes (in other's axis order); the product is
  taken in whichever operand order yields them in the operand's own axis
  order, if one does (e.g. ``x.T @ g`` for a kernel), so that XLA needs no
  transpose of the result, and is permuted otherwise.
  """
  q_op = operand[0]
  q_other = other[0]
  (lc, rc), (lb, rb) = dims
  if not operand_is_lhs:
    lc, rc, lb, rb = rc, lc, rb, lb
  op_free = _free_axes(q_op.ndim, lc, lb)
  other_free = _free_axes(q_other.ndim, rc, rb)
  nb, nf = len(lb), len(op_free)
  first_other = nb + nf if operand_is_lhs else nb  # where other's free axes sit in g
  g_other = tuple(range(first_other, first_other + len(other_free)))
  # Result axes, named by the operand axis each one becomes.
  contracting = [lc[rc.index(a)] for a in sorted(rc)]
  g_first = [*lb, *op_free, *contracting]
  other_first = [*lb, *contracting, *op_free]
  batch = tuple(range(nb))
  if other_first == sorted(other_first) and g_first != sorted(g_first):
    order = other_first
    pair, pair_dims = (other, g), ((other_free, g_other), (rb, batch))
  else:
    order = g_first
    pair, pair_dims = (g, other), ((g_other, other_free), (batch, rb))
  sharding = _sharding.result_sharding(q_op, order)
  out = _scaled_dot(*pair, pair_dims, out_dtype, precision, sharding)
  if order == sorted(order):
    return out
  return lax.transpose(out, tuple(int(i) for i in np.argsort(order)))


class DotSpec(NamedTuple):
  """The static (hashable) part of one fp8 matmul."""

  dims: tuple
  fwd_dtype: np.dtype
  bwd_dtype: np.dtype
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_sharding: Any
  probe_axes: frozenset  # the shard_map axes the amax probe varies over
  current_scaling: bool  # traced under current_scaling(): scales from this step's amaxes
  margin: float
  fwd_precision: Any  # lax.Precision.DEFAULT lets XLA:GPU use fast fp8 accumulation
  bwd_precision: Any
  power_of_2: bool = False  # current scales rounded up to a power of two
  trust_state: bool = False  # delayed scales used as they are: no own-amax fallback, no select


class PerTensorFormats(Protocol):
  """What the per-tensor matmul reads of a recipe (``Fp8Config``, ``CurrentScaling``)."""

  @property
  def fwd_dtype(self) -> Any: ...
  @property
  def bwd_dtype(self) -> Any: ...
  @property
  def margin(self) -> float: ...
  @property
  def fast_accumulation(self) -> str: ...


def _precisions(config: PerTensorFormats) -> tuple[Any, Any]:
  """(forward, backward) matmul precisions for ``config.fast_accumulation``.

  XLA:GPU accumulates an fp8 GEMM with Hopper's fast (fewer-bit) accumulator
  when the dot's precision is ``DEFAULT`` and in fp32 when it is ``HIGHEST``
  (``IsFastAccumEnabled`` in XLA's cuBLASLt wrapper).
  """
  fast, exact = lax.Precision.DEFAULT, lax.Precision.HIGHEST
  mode = config.fast_accumulation
  return (fast if mode in ("forward", "all") else exact), (fast if mode == "all" else exact)


def power_of_2_above(scale: jax.Array) -> jax.Array:
  r"""The least power of two :math:`\geq` ``scale`` (a positive finite float32), exactly.

  A scale rounded up still maps the amax into the format's range, and a
  power-of-two scale makes the division by it exact.
  """
  mantissa, exponent = jnp.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
  exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
  return jnp.ldexp(jnp.ones_like(scale), exponent)


def scale_for(state_scale, amax, dtype, spec) -> jax.Array:
  r"""The scale one tensor is quantized with.

  Under current scaling, the tensor's own: :func:`compute_scale` of its amax
  (rounded up to a power of two with ``spec.power_of_2``). With delayed
  scaling, the state's, unless the state has none yet (a scale of 0: a fresh
  state whose history never saw a nonzero amax), when it is the tensor's own
  too, so that a first step cannot flush or saturate a tensor silently.
  With ``spec.trust_state`` (a state calibrated before the first step) the
  state's scale is used as it is and a missing one is NaN: the tensor's
  quantization reads nothing of its amax (no select, so it fuses with the
  amax's pass), and an uncalibrated tensor makes the product NaN, not zero.
  """
  known = state_scale > 0
  if spec.trust_state and not spec.current_scaling:
    return jnp.where(known, state_scale, jnp.float32(jnp.nan))
  own = compute_scale(amax, jnp.where(known, state_scale, 1.0), dtype, spec.margin)
  if spec.power_of_2:
    own = power_of_2_above(own)
  if spec.current_scaling:  # static: the delayed program has only the select below
    return own
  return jnp.where(known, state_scale, own)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def fp8_dot(lhs, rhs, scales, probe, loss_scale, spec):
  """The fp8 matmul with its VJP: ``(lhs, rhs, scales, probe, loss_scale, DotSpec) -> out``."""
  return _fp8_dot_fwd(lhs, rhs, scales, probe, loss_scale, spec)[0]


def _fp8_dot_fwd(lhs, rhs, scales, probe, loss_scale, spec):
  del probe  # only its cotangent matters
  input_scale, kernel_scale, grad_scale = scales
  # Each amax reads the same tensor as its quantization (siblings XLA can fuse
  # into one pass); with delayed scaling neither waits for the other.
  lhs_amax, rhs_amax = compute_amax(lhs), compute_amax(rhs)
  input_scale = scale_for(input_scale, lhs_amax, spec.fwd_dtype, spec)
  kernel_scale = scale_for(kernel_scale, rhs_amax, spec.fwd_dtype, spec)
  q_lhs = quantize(lhs, input_scale, spec.fwd_dtype)
  q_rhs = quantize(rhs, kernel_scale, spec.fwd_dtype)
  out = _scaled_dot(
    (q_lhs, input_scale), (q_rhs, kernel_scale), spec.dims, spec.out_dtype,
    spec.fwd_precision, spec.out_sharding,
  )  # fmt: skip
  # Residuals are the 1-byte quantized operands, not the 2-4 byte originals.
  scales = (input_scale, kernel_scale, grad_scale)
  residuals = (q_lhs, q_rhs, scales, loss_scale, lhs_amax, rhs_amax)
  return out, residuals


def _fp8_dot_bwd(spec, residuals, g):
  q_lhs, q_rhs, (input_scale, kernel_scale, grad_scale), loss_scale, lhs_amax, rhs_amax = residuals
  # g carries the loss scale S. Quantizing with grad_scale * S gives the same
  # fp8 values as unscaled training (exactly, for a power-of-two S), and the
  # amax is recorded unscaled, so a change of S never moves the fp8 scales.
  grad_amax = compute_amax(g) / loss_scale
  grad_scale = scale_for(grad_scale, grad_amax, spec.bwd_dtype, spec)
  scale = grad_scale * loss_scale
  q_g = quantize(g, scale, spec.bwd_dtype)
  g, lhs, rhs = (q_g, scale), (q_lhs, input_scale), (q_rhs, kernel_scale)
  d_lhs = _operand_cotangent(g, lhs, rhs, spec.dims, True, spec.lhs_dtype, spec.bwd_precision)
  d_rhs = _operand_cotangent(g, rhs, lhs, spec.dims, False, spec.rhs_dtype, spec.bwd_precision)
  observed = Fp8DotAmax(
    *(_sharding.match_varying(a, spec.probe_axes) for a in (lhs_amax, rhs_amax, grad_amax))
  )
  return d_lhs, d_rhs, None, observed, None


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def loss_scale_value(loss_scale: Any) -> jax.Array:
  """A float32 scalar from None (1), a jmp_lite loss scale's ``gradient_scale``, or a number."""
  if loss_scale is None:
    return jnp.ones((), F32)
  # A loss scale without one gradient scale (layer-wise, several stages) is refused: the matmul
  # cannot know which scale its gradient carries; its own per-tensor scale adapts to it anyway.
  return gradient_scale_value(
    loss_scale,
    instead="fp8's delayed scaling already scales each matmul's output gradient on its own: "
    "use jl.DynamicLossScale (or jl.NoOpLossScale with bf16) for the 16-bit parts, or "
    "fp8.CurrentScaling, which takes any loss scale.",
  )


def check_operand(x: Any, name: str) -> jax.Array:
  """``x`` as an array if it is floating and 16 or 32 bits; TypeError/ValueError otherwise."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"fp8 {name} must be a floating-point array, got dtype {x.dtype}.")
  not_fp8 = lambda d: not dtypes.is_float8(d)
  expected = "in 16 or 32 bits (it is quantized here with its scale)"
  _validation.check_dtype(x.dtype, f"fp8 {name}", not_fp8, expected)
  return x


def _check_dot_state(state: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
  if not isinstance(state, Fp8DotState):
    raise TypeError(
      f"state must be an Fp8DotState (see init_dot_state), got {type(state).__name__}."
    )
  scales = []
  for name, tensor in zip(Fp8DotState._fields, state, strict=True):
    scale = jnp.asarray(tensor.scale, F32)
    if scale.shape != ():
      raise ValueError(f"state.{name}.scale must be a scalar, got shape {scale.shape}.")
    scales.append(scale)
  return scales[0], scales[1], scales[2]


def _check_probe(amax: Any) -> Fp8DotAmax:
  if amax is None:
    zero = jnp.zeros((), F32)
    return Fp8DotAmax(zero, zero, zero)
  if not isinstance(amax, Fp8DotAmax):
    raise TypeError(f"amax must be an Fp8DotAmax (see zeros_amax), got {type(amax).__name__}.")
  return Fp8DotAmax(*(jnp.asarray(a, F32) for a in amax))


def _traced_under_current_scaling(probed: bool) -> bool:
  """Whether the op being traced is inside :func:`current_scaling`; counts it if probed."""
  scopes = _current_scaling.SCOPES.all()
  if probed:
    for scope in scopes:
      scope.probed_ops += 1
  return bool(scopes)


class DotOptions(TypedDict, total=False):
  """The keyword options of :func:`dot_general`, which :func:`einsum` passes on."""

  config: Any
  loss_scale: Any
  precision: Any
  preferred_element_type: Any
  out_sharding: Any


class DotCall(NamedTuple):
  """One fp8 matmul call, checked: what every recipe's ``dot_general`` receives."""

  lhs: jax.Array
  rhs: jax.Array
  dims: tuple  # canonical ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))
  out_dtype: np.dtype
  loss_scale: Any  # as given: each recipe reads (or refuses) it
  out_sharding: Any


def check_call(lhs, rhs, dimension_numbers, preferred_element_type, loss_scale, out_sharding):
  """Checks the operands and dimension numbers of an fp8 matmul; a :class:`DotCall`."""
  lhs, rhs = check_operand(lhs, "lhs"), check_operand(rhs, "rhs")
  dims = _canonical_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
  if preferred_element_type is None:
    out_dtype = jnp.result_type(lhs, rhs)
  else:
    out_dtype = np.dtype(preferred_element_type)
  return DotCall(lhs, rhs, dims, out_dtype, loss_scale, out_sharding)


def per_tensor_dot(
  call: DotCall,
  state: Fp8DotState | None,
  amax: Fp8DotAmax | None,
  config: PerTensorFormats,
  *,
  current: bool,
  power_of_2: bool = False,
  trust_state: bool = False,
) -> jax.Array:
  """The per-tensor fp8 matmul (:func:`fp8_dot`) for a call, with delayed or current scales.

  ``state`` None (current scaling only) quantizes a zero tensor with a scale of 1.
  ``trust_state`` (delayed scaling): the state's scales as they are (:func:`scale_for`).
  """
  if state is None:
    one = jnp.ones((), F32)
    scales, loss_scale = (one, one, one), one  # current scales do not depend on it
  else:
    scales, loss_scale = _check_dot_state(state), loss_scale_value(call.loss_scale)
  probe_axes, probe = _sharding.vary_like_union(*_check_probe(amax))
  _, (lhs, rhs) = _sharding.vary_like_union(call.lhs, call.rhs)
  spec = DotSpec(
    call.dims,
    config.fwd_dtype,
    config.bwd_dtype,
    call.out_dtype,
    lhs.dtype,
    rhs.dtype,
    call.out_sharding,
    probe_axes,
    _traced_under_current_scaling(amax is not None) or current,
    config.margin,
    *_precisions(config),
    power_of_2,
    trust_state,
  )
  return fp8_dot(lhs, rhs, scales, Fp8DotAmax(*probe), loss_scale, spec)
