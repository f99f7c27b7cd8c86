"""fp8 matmuls with per-tensor delayed scaling (E4M3 forward, E5M2 backward).

An fp8 matmul quantizes each operand with its own scale :math:`s`, multiplies
the 8-bit values with fp32 accumulation, and multiplies the result back by the
scales:

.. math::

  q(x) = \\mathrm{fp8}\\big(\\mathrm{sat}(x / s_x)\\big), \\qquad
  y = \\big(q(x) \\cdot q(k)\\big)_{\\text{fp32}} \\; s_x s_k

where :math:`\\mathrm{sat}` clips finite values to the format's largest value
(448 for E4M3, 57344 for E5M2; see :data:`jmp_lite.dtypes.FORMATS`). In the
backward pass the output gradient :math:`g` is quantized to E5M2 with its own
scale :math:`s_g` (gradients need range more than precision), and

.. math::

  \\partial x = \\big(q(g) \\cdot q(k)^\\top\\big)_{\\text{fp32}} \\; s_g s_k, \\qquad
  \\partial k = \\big(q(x)^\\top \\cdot q(g)\\big)_{\\text{fp32}} \\; s_x s_g .

Delayed scaling picks each scale from the absolute maxima (amax) seen in
earlier steps: the state of one tensor is its current scale and a history of
the last :math:`L` amaxes (:class:`Fp8ScaleState`). After a step that observed
:math:`a_t = \\max |x_t|`,

.. math::

  h \\leftarrow (a_t, h_0, \\dots, h_{L-2}), \\qquad
  A = \\begin{cases} \\max_i h_i & \\texttt{"max"} \\\\ h_0 & \\texttt{"most_recent"}\\end{cases},
  \\qquad
  s \\leftarrow \\begin{cases}
    A \\cdot 2^{\\text{margin}} / \\text{fp8\\_max} & 0 < A < \\infty \\\\
    s & \\text{otherwise (keep the previous scale)}
  \\end{cases}

The step itself only *reads* the scales; what it observed comes back as the
gradient of a zero-valued "amax probe" (:class:`Fp8DotAmax`), because the
output-gradient amax exists only in the backward pass. :func:`update` then
folds the observations into the state, outside differentiation::

  state = fp8.init_dot_state()            # one per matmul, in any pytree

  def loss_fn(params, amax):
    y = fp8.dot_general(x, params, (((1,), (0,)), ((), ())), state, amax)
    return jnp.mean((y - target) ** 2)

  grads, amax = jax.grad(loss_fn, argnums=(0, 1))(params, fp8.zeros_amax(state))
  state = fp8.update(state, amax)         # axis_name=... under shard_map/pmap

Observations from several devices or gradient-accumulation microsteps are
combined with ``max`` (:func:`reduce_amax`, :func:`combine_amax`), never summed.

A fresh state has no history, and its scales of 1 flush every value below the
format's smallest subnormal (output gradients under :math:`2^{-16}` in E5M2)
and saturate every value above its largest. :func:`calibrate` fills the
history from one batch before training, with one pass under
:func:`current_scaling` (each tensor quantized with the scale of its own amax),
so the first step's error is rounding only; the training step is unchanged::

  state = fp8.calibrate(lambda amax: loss_fn(params, amax), state, config)

See ``docs/fp8.md`` for the design, the Flax integration and the differences
from ``flax.linen.fp8_ops``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import numbers
import string
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _policy as policy_lib
from jmp_lite import _validation
from jmp_lite._loss_scale import LossScale

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FAST_ACCUMULATION = ("none", "forward", "all")
_F32 = np.dtype(jnp.float32)


# -----------------------------------------------------------------------------
# Configuration


def _as_fp8_dtype(value: Any, name: str) -> np.dtype:
  """Parses a dtype and checks that it is one of the fp8 formats in FORMATS."""
  dtype = dtypes.parse_dtype(value)  # TypeError/ValueError for junk
  if not dtypes.is_float8(dtype) or dtype.name not in dtypes.FORMATS:
    supported = ", ".join(d.name for d in dtypes.FLOAT8_DTYPES)
    raise ValueError(f"{name} must be an fp8 format ({supported}), got {dtype.name}.")
  return dtype


def _check_history_length(value: Any) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"amax_history_length must be an int >= 1, got {value!r}.")
  if value < 1:
    raise ValueError(f"amax_history_length must be >= 1, got {value}.")
  return int(value)


def _check_margin(value: Any) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"margin must be a finite number >= 0, got {value!r}.")
  margin = float(value)
  # 2**margin must stay a finite fp32 factor; margins used in practice are 0-4.
  if not (math.isfinite(margin) and 0 <= margin < 64):
    raise ValueError(f"margin must be finite, >= 0 and < 64, got {value!r}.")
  return margin


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """How fp8 matmuls quantize and how their scales adapt (hashable, jit-static).

  Attributes:
    fwd_dtype: format of the inputs and kernels in the forward pass (default
      ``float8_e4m3fn``: 3 mantissa bits, max 448).
    bwd_dtype: format of the output gradient in the backward pass (default
      ``float8_e5m2``: 2 mantissa bits, max 57344). E4M3 forward with E5M2
      backward is Transformer Engine's "hybrid" recipe.
    amax_history_length: how many steps of amax each tensor remembers (>= 1).
    amax_compute_algo: ``"max"`` takes the largest amax in the history (robust
      to a tensor whose range shrinks for a step), ``"most_recent"`` the last
      one (adapts fastest).
    margin: extra headroom in powers of two: the scale maps ``amax * 2**margin``
      to the format's largest value.
    fast_accumulation: which matmuls may use the GPU's fast fp8 accumulation
      (Hopper's fp8 tensor cores then keep fewer bits of the running sum than
      fp32): ``"none"`` (default: every sum in fp32), ``"forward"`` (the
      forward matmul only, Transformer Engine's default; gradients stay
      exact-product, fp32-sum), or ``"all"``. It sets the matmuls'
      ``precision`` (``DEFAULT`` for fast, ``HIGHEST`` otherwise), which
      XLA:GPU reads; XLA:CPU sums in fp32 either way.

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
    set_("fwd_dtype", _as_fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    set_("bwd_dtype", _as_fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    set_("amax_history_length", _check_history_length(self.amax_history_length))
    choice = _validation.check_choice
    set_(
      "amax_compute_algo", choice(self.amax_compute_algo, "amax_compute_algo", AMAX_COMPUTE_ALGOS)
    )
    set_("margin", _check_margin(self.margin))
    set_(
      "fast_accumulation", choice(self.fast_accumulation, "fast_accumulation", FAST_ACCUMULATION)
    )


def _as_config(config: Fp8Config | None) -> Fp8Config:
  if config is None:
    return Fp8Config()
  if not isinstance(config, Fp8Config):
    raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}.")
  return config


# -----------------------------------------------------------------------------
# State


class Fp8ScaleState(NamedTuple):
  """Delayed-scaling state of one tensor.

  Attributes:
    scale: float32 scalar, the value of one fp8 unit: ``x ~= scale * q``. It
      is the scale the *next* step quantizes with.
    amax_history: float32 ``[L]``, the observed absolute maxima, most recent
      first (index 0), oldest last.
  """

  scale: jax.Array
  amax_history: jax.Array


class Fp8DotState(NamedTuple):
  """Scales of one fp8 matmul: its input (lhs), kernel (rhs) and output gradient."""

  input: Fp8ScaleState
  kernel: Fp8ScaleState
  output_grad: Fp8ScaleState


class Fp8DotAmax(NamedTuple):
  """What one matmul observed in a step: the amax of each of its tensors.

  Passed into :func:`dot_general` as zeros (the "probe"); its gradient holds
  the observations. The output-gradient amax is in unscaled units (divided by
  the loss scale).
  """

  input: jax.Array
  kernel: jax.Array
  output_grad: jax.Array


def init_scale_state(amax_history_length: int = 1024) -> Fp8ScaleState:
  """A scale of 1 and an all-zero history (zero amaxes keep the scale at 1).

  Scale 1 suits no particular tensor: :func:`calibrate` sets the scales from a
  first batch before training.
  """
  length = _check_history_length(amax_history_length)
  return Fp8ScaleState(jnp.ones((), _F32), jnp.zeros((length,), _F32))


def init_dot_state(config: Fp8Config | None = None) -> Fp8DotState:
  """The initial :class:`Fp8DotState` of one matmul."""
  length = _as_config(config).amax_history_length
  return Fp8DotState(*(init_scale_state(length) for _ in Fp8DotState._fields))


def _is_dot_state(x: Any) -> bool:
  return isinstance(x, Fp8DotState)


def zeros_amax(state: Any) -> Any:
  """The amax probes for a pytree of :class:`Fp8DotState`: each replaced by zeros.

  Differentiate the loss with respect to these (``argnums``) to collect the
  observations :func:`update` needs.
  """

  def probe(dot_state: Any) -> Fp8DotAmax:
    if not isinstance(dot_state, Fp8DotState):
      raise TypeError(f"Expected Fp8DotState nodes in the state, found {type(dot_state).__name__}.")
    # Shaped like the scales, so stacked states (nn.scan layers) get stacked probes.
    return Fp8DotAmax(*(jnp.zeros(jnp.shape(t.scale), _F32) for t in dot_state))

  return jax.tree.map(probe, state, is_leaf=_is_dot_state)


# -----------------------------------------------------------------------------
# Quantization


def compute_amax(x: jax.typing.ArrayLike) -> jax.Array:
  """``max |x|`` as a float32 scalar (0 for an empty array; NaN if x has one)."""
  x = jnp.asarray(x)
  return jnp.max(jnp.abs(x), initial=0).astype(_F32)


def quantize(x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, dtype: Any) -> jax.Array:
  """Returns ``x / scale`` rounded to the fp8 ``dtype``, saturating finite values.

  The division is done in float32 and rounds to nearest even. Finite values
  beyond the format's range clip to +-max (the amax grew since the scale was
  computed); inf and NaN stay non-finite (NaN in ``float8_e4m3fn``, which has
  no inf), so an overflow upstream still reaches the finiteness check of
  :func:`jmp_lite.loss_scaling` instead of being clipped into a finite value.
  """
  dtype = _as_fp8_dtype(dtype, "dtype")
  fp8_max = dtypes.FORMATS[dtype.name].max
  x = jnp.asarray(x).astype(_F32)
  y = x / jnp.asarray(scale, _F32)
  return jnp.where(jnp.isfinite(x), jnp.clip(y, -fp8_max, fp8_max), y).astype(dtype)


def dequantize(
  q: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, dtype: Any = _F32
) -> jax.Array:
  """Returns ``q * scale`` (computed in float32) in ``dtype``."""
  q = jnp.asarray(q)
  return (q.astype(_F32) * jnp.asarray(scale, _F32)).astype(dtype)


def quantize_dequantize(
  x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, dtype: Any
) -> jax.Array:
  """``dequantize(quantize(x, scale, dtype), scale)`` in x's dtype: the fp8 value of x."""
  x = jnp.asarray(x)
  return dequantize(quantize(x, scale, dtype), scale, x.dtype)


# -----------------------------------------------------------------------------
# Scale updates


def compute_scale(
  amax: jax.typing.ArrayLike,
  previous_scale: jax.typing.ArrayLike,
  dtype: Any,
  margin: float = 0.0,
) -> jax.Array:
  """The scale that maps ``amax * 2**margin`` to the largest value of ``dtype``.

  .. math:: s = \\frac{A \\cdot 2^{\\text{margin}}}{\\text{fp8\\_max}}

  Keeps ``previous_scale`` when ``amax`` is zero, negative or non-finite (no
  information: an all-zero tensor, or an overflow), and when the new scale
  would underflow to zero or overflow float32.

  >>> float(compute_scale(896.0, 1.0, "float8_e4m3fn"))
  2.0
  """
  fp8_max = dtypes.FORMATS[_as_fp8_dtype(dtype, "dtype").name].max
  margin = _check_margin(margin)
  amax = jnp.asarray(amax, _F32)
  previous_scale = jnp.asarray(previous_scale, _F32)
  scale = amax / jnp.float32(fp8_max) * jnp.float32(2.0**margin)
  usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
  return jnp.where(usable, scale, previous_scale)


def update_scale(
  state: Fp8ScaleState,
  amax: jax.typing.ArrayLike,
  dtype: Any,
  *,
  margin: float = 0.0,
  amax_compute_algo: str = "max",
) -> Fp8ScaleState:
  """Pushes one observed amax into the history and recomputes the scale.

  A non-finite observation (an overflowed step) is dropped: the history and
  scale are unchanged. Pushing it would pin the ``"max"`` rule to inf, which
  keeps the old scale, for ``L`` steps.

  Stacked states (``scale`` of shape ``[...]``, ``amax_history`` of shape
  ``[..., L]``, e.g. the layers of ``nn.scan``) update elementwise with an
  ``amax`` of shape ``[...]``.

  >>> state = init_scale_state(3)
  >>> state = update_scale(state, 448.0, "float8_e4m3fn")
  >>> float(state.scale), state.amax_history.tolist()
  (1.0, [448.0, 0.0, 0.0])
  """
  algo = _validation.check_choice(amax_compute_algo, "amax_compute_algo", AMAX_COMPUTE_ALGOS)
  history = jnp.asarray(state.amax_history)
  scale = jnp.asarray(state.scale)
  if history.ndim < 1 or history.shape[-1] < 1 or history.shape[:-1] != scale.shape:
    raise ValueError(
      f"amax_history must have shape scale.shape + (L,) with L >= 1; got amax_history "
      f"{history.shape} and scale {scale.shape}."
    )
  amax = jnp.asarray(amax, history.dtype)
  if amax.shape != scale.shape:
    raise ValueError(f"amax must have the scale's shape {scale.shape}, got {amax.shape}.")
  pushed = jnp.concatenate([amax[..., None], history[..., :-1]], axis=-1)
  history = jnp.where(jnp.isfinite(amax)[..., None], pushed, history)
  summary = jnp.max(history, axis=-1) if algo == "max" else history[..., 0]
  return Fp8ScaleState(compute_scale(summary, scale, dtype, margin), history)


def reduce_amax(amax: Any, axis_name: Any) -> Any:
  """Max of the observations across a ``shard_map``/``pmap`` axis (or axes).

  Every device must quantize with the same scale, and the scale must cover the
  largest value any device saw: max, not sum or mean (a mean would saturate the
  devices with the largest values). Not needed under sharded ``jit``, where
  amaxes are already global.
  """
  return jax.tree.map(lambda a: lax.pmax(a, axis_name), amax)


def combine_amax(*amaxes: Any) -> Any:
  """Elementwise max of the observations of several gradient-accumulation microsteps.

  NaN or inf in any of them (an overflowed microstep) wins, so :func:`update`
  drops that tensor's observation for the accumulated step.
  """
  if not amaxes:
    raise TypeError("combine_amax needs at least one amax tree.")
  return jax.tree.map(lambda *a: functools.reduce(jnp.maximum, a), *amaxes)


def update(state: Any, amax: Any, config: Fp8Config | None = None, *, axis_name: Any = None) -> Any:
  """Folds one step's observations into a pytree of :class:`Fp8DotState`.

  Args:
    state: any pytree whose fp8 nodes are :class:`Fp8DotState` (e.g. the
      ``"fp8_state"`` collection of a Flax linen model).
    amax: the matching pytree of :class:`Fp8DotAmax` (the gradient of
      :func:`zeros_amax`), possibly combined over microsteps.
    config: formats, margin and amax rule (the history length comes from the
      state's arrays).
    axis_name: under ``shard_map``/``pmap``, the axis (or axes) to max-reduce
      the observations over first, so every device computes the same scales.

  Returns:
    The new state, with the same structure. Inputs and kernels use
    ``config.fwd_dtype``, output gradients ``config.bwd_dtype``.
  """
  config = _as_config(config)
  if axis_name is not None:
    amax = reduce_amax(amax, axis_name)
  kw: dict[str, Any] = {"margin": config.margin, "amax_compute_algo": config.amax_compute_algo}

  def update_dot(dot_state: Any, dot_amax: Any) -> Fp8DotState:
    if not isinstance(dot_state, Fp8DotState):
      raise TypeError(
        f"Expected the state's leaves to be Fp8DotState nodes, found {type(dot_state).__name__}."
      )
    if not isinstance(dot_amax, Fp8DotAmax):
      raise TypeError(
        "amax must mirror the state with an Fp8DotAmax for each Fp8DotState (see zeros_amax), "
        f"found {type(dot_amax).__name__}."
      )
    return Fp8DotState(
      input=update_scale(dot_state.input, dot_amax.input, config.fwd_dtype, **kw),
      kernel=update_scale(dot_state.kernel, dot_amax.kernel, config.fwd_dtype, **kw),
      output_grad=update_scale(dot_state.output_grad, dot_amax.output_grad, config.bwd_dtype, **kw),
    )

  try:
    return jax.tree.map(update_dot, state, amax, is_leaf=_is_dot_state)
  except ValueError as e:
    raise ValueError(
      f"The amax tree does not match the fp8 state tree; build it with zeros_amax(state). {e}"
    ) from e


# -----------------------------------------------------------------------------
# The first step


class CurrentScalingScope:
  """What :func:`current_scaling` yields: ``probed_ops`` counts the fp8 ops
  traced inside with an amax probe (0: nothing would be observed)."""

  def __init__(self) -> None:
    self.probed_ops = 0


class _CurrentScalingScopes(threading.local):
  def __init__(self) -> None:
    self.active: list[CurrentScalingScope] = []


_current_scaling_scopes = _CurrentScalingScopes()


@contextlib.contextmanager
def current_scaling() -> Iterator[CurrentScalingScope]:
  r"""Inside, fp8 ops quantize each tensor with the scale of its own amax.

  Read when an op is traced (as :func:`jax.named_scope` is): every
  :func:`dot_general` and :func:`einsum` traced inside quantizes its input,
  kernel and output gradient :math:`x` with

  .. math:: s = \texttt{compute\_scale}(\max|x|,\ s_{\text{state}},\ \text{dtype},\ \text{margin})

  instead of the state's scale :math:`s_{\text{state}}` (which it keeps only
  for an all-zero or non-finite tensor), and reports the amaxes through its
  probe as usual. Each quantization then waits for a reduction over its own
  tensor, which delayed scaling exists to avoid; :func:`calibrate` uses it for
  one pass before training.

  A ``jax.jit`` function traced before, outside the context, keeps its
  compiled delayed-scaling program: trace the fp8 ops inside. The
  :class:`CurrentScalingScope` it yields counts the ops that were.
  """
  scope = CurrentScalingScope()
  _current_scaling_scopes.active.append(scope)
  try:
    yield scope
  finally:
    _current_scaling_scopes.active.pop()


def calibrate(
  fun: Callable[..., Any],
  state: Any,
  config: Fp8Config | None = None,
  *,
  has_aux: bool = False,
  axis_name: Any = None,
) -> Any:
  r"""Sets the scales of a fresh fp8 state from one batch, before the first training step.

  Takes ``jax.grad(fun)(zeros_amax(state))`` once under :func:`current_scaling`
  and folds the observations into ``state`` with :func:`update`. No tensor is
  flushed or saturated in that pass, so every layer's output gradient is
  observed as it is (with the initial scales of 1, a flushed gradient would
  also zero the gradients, and the observations, of every layer below it).
  Each scale then maps its tensor's amax to the format's largest value,

  .. math:: s = \frac{\max|x| \cdot 2^{\text{margin}}}{\text{fp8\_max}},

  and a first training step on the same batch quantizes exactly as this pass
  did: its error is fp8 rounding, not a flush to zero or a saturation. Each
  call pushes one observation per tensor, so calibrating on several batches
  makes the ``"max"`` rule cover all of them.

  This is a separate pass, not current scaling inside the training step while
  the history is empty, so that the training step stays the program it was. A
  ``jnp.where`` between the delayed and the current scale would make every
  quantization wait for a reduction over its tensor in every step (the cast
  could no longer share the pass that produces the tensor and its amax); a
  ``lax.cond`` is a fusion barrier, and XLA:GPU (outside CUDA graphs) copies its
  predicate to the host and waits for it at every execution. The cost here is
  one forward and backward pass and one compilation, once.

  Args:
    fun: the loss of one batch as a function of the amax probes: ``fun(amax)``,
      closing over the parameters, the batch and ``state`` (e.g.
      ``lambda amax: loss_fn(params, amax)`` with the training step's loss).
      It need not scale the loss; if it does, it must pass the loss scale to
      the ops, as the training step does.
    state: the pytree of :class:`Fp8DotState` that ``fun`` reads, fresh from
      :func:`init_dot_state` or a Flax ``init``.
    config: formats, margin and amax rule (the ops' ``config``).
    has_aux: ``fun`` returns ``(loss, aux)``; ``aux`` is dropped.
    axis_name: as in :func:`update`.

  Returns:
    The calibrated state, with the same structure.

  >>> state = init_dot_state(Fp8Config(amax_history_length=4))
  >>> x, k = jnp.full((2, 3), 896.0), jnp.full((3, 2), 0.4375)
  >>> def loss(amax):  # output gradients of 57344 * 2**-40 ~ 2**-24: zero at scale 1
  ...   y = dot_general(x, k, (((1,), (0,)), ((), ())), state, amax)
  ...   return jnp.sum(y) * (57344 * 2.0**-40)
  >>> calibrated = jax.jit(calibrate, static_argnums=0)(loss, state)  # or eagerly
  >>> [float(t.scale) for t in calibrated]
  [2.0, 0.0009765625, 9.094947017729282e-13]
  """
  if not callable(fun):
    raise TypeError(f"fun must be a function of the amax probes, got {fun!r}.")
  config = _as_config(config)
  probes = zeros_amax(state)
  if not jax.tree.leaves(probes):
    raise ValueError(f"state holds no Fp8DotState to calibrate: {state!r}.")
  with current_scaling() as scope:
    amax = jax.grad(fun, has_aux=has_aux)(probes)
  if scope.probed_ops == 0:
    raise ValueError(
      "fun traced no fp8 matmul with an amax probe, so nothing was calibrated: trace the fp8 "
      "ops inside fun (not a jax.jit function compiled before) and give them the probes (the "
      "amax argument; linen: the 'fp8_amax' collection)."
    )
  if has_aux:
    amax, _ = amax
  return update(state, amax, config, axis_name=axis_name)


# -----------------------------------------------------------------------------
# The matmul


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


def _result_sharding(operand: jax.Array, axes: list[int]) -> Any:
  """The sharding of a cotangent computed with its axes in the order ``axes``.

  Under explicit sharding a matmul that contracts a sharded axis needs its
  output sharding spelled out; a cotangent is sharded like its primal, whose
  spec is permuted here to the matmul's output order (as JAX's own transpose
  rule for dot_general does).
  """
  sharding = getattr(_aval(operand), "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  if sharding.mesh.empty:  # an unsharded operand inside a computation over a mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * len(axes))))
  spec = tuple(sharding.spec) + (None,) * (operand.ndim - len(sharding.spec))
  return jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec(*(spec[a] for a in axes))
  )


def _aval(x: Any) -> Any:
  return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)  # type: ignore[attr-defined]


def _varying_axes(x: Any) -> frozenset:
  """The shard_map mesh axes over which x varies (empty outside shard_map)."""
  aval = _aval(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.9
  if manual is not None:
    return frozenset(getattr(manual, "varying", ()))
  return frozenset(getattr(aval, "vma", ()))


def _sorted_axes(axes: frozenset) -> tuple:
  return tuple(sorted(axes, key=str))


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
  """Marks an invariant x as varying over ``axes`` (its transpose sums over them)."""
  if not axes:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, _sorted_axes(axes), to="varying")
  return lax.pvary(x, _sorted_axes(axes))  # type: ignore[attr-defined]  # older JAX


def _match_varying(amax: jax.Array, axes: frozenset) -> jax.Array:
  """Gives an observed amax the probe's shard_map type: max over the extra axes.

  JAX would otherwise *sum* the cotangent over the axes the probe is
  invariant along, as it does for parameters; an amax must be max-reduced.
  """
  have = _varying_axes(amax)
  if have - axes:
    amax = lax.pmax(amax, _sorted_axes(have - axes))
  return _vary(amax, axes - have)


# -----------------------------------------------------------------------------
# The GEMM form
#
# Each matmul takes the fp8 arrays themselves as operands, with an fp32 result
# that is multiplied by the product of the scales and then cast:
#
#   dot(q_a, q_b) -> f32, * broadcast(s_a * s_b), convert
#
# XLA:GPU turns this into one cuBLASLt fp8 GEMM with the scale applied to the
# fp32 sum (measured on an H200: every matmul of the LM in benchmarks/gpu.py).
# The other form its GEMM rewriter knows, dequantized operands
# ``dot(convert(q_a) * s_a, convert(q_b) * s_b)``, is not safe to emit from
# JAX: XLA:GPU's conversion simplification removes the ``bf16 -> fp8 -> bf16``
# round trip of the quantization, and the "fp8" matmul silently ran as a plain
# bf16 GEMM on unquantized values (no fp8 GEMM, no f8 type left in the
# optimized HLO; benchmarks/gpu.py, docs/benchmarks.md). fp8 x fp8 products are
# exact in fp32, so the sum is exact up to fp32 rounding whatever the form.


def _scaled_dot(a, b, dims, out_dtype, precision, out_sharding=None) -> jax.Array:
  """``(q_a s_a) . (q_b s_b)`` in ``out_dtype`` from ``a = (q_a, s_a)``, ``b = (q_b, s_b)``.

  fp8 operands, an fp32 sum scaled once and rounded once to ``out_dtype``.
  """
  (q_a, s_a), (q_b, s_b) = a, b
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  out = lax.dot_general(q_a, q_b, dims, precision, preferred_element_type=_F32, **kwargs)
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
    out = _scaled_dot(
      other, g, ((other_free, g_other), (rb, batch)), out_dtype, precision,
      _result_sharding(q_op, order),
    )  # fmt: skip
  else:
    order = g_first
    out = _scaled_dot(
      g, other, ((g_other, other_free), (batch, rb)), out_dtype, precision,
      _result_sharding(q_op, order),
    )  # fmt: skip
  if order == sorted(order):
    return out
  return lax.transpose(out, tuple(int(i) for i in np.argsort(order)))


class _DotSpec(NamedTuple):
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


def _precisions(config: Fp8Config) -> tuple[Any, Any]:
  """(forward, backward) matmul precisions for ``config.fast_accumulation``.

  XLA:GPU accumulates an fp8 GEMM with Hopper's fast (fewer-bit) accumulator
  when the dot's precision is ``DEFAULT`` and in fp32 when it is ``HIGHEST``
  (``IsFastAccumEnabled`` in XLA's cuBLASLt wrapper).
  """
  fast, exact = lax.Precision.DEFAULT, lax.Precision.HIGHEST
  mode = config.fast_accumulation
  return (fast if mode in ("forward", "all") else exact), (fast if mode == "all" else exact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fp8_dot(lhs, rhs, scales, probe, loss_scale, spec):
  return _fp8_dot_fwd(lhs, rhs, scales, probe, loss_scale, spec)[0]


def _fp8_dot_fwd(lhs, rhs, scales, probe, loss_scale, spec):
  del probe  # only its cotangent matters
  input_scale, kernel_scale, grad_scale = scales
  # Each amax reads the same tensor as its quantization (siblings XLA can fuse
  # into one pass); with delayed scaling neither waits for the other.
  lhs_amax, rhs_amax = compute_amax(lhs), compute_amax(rhs)
  if spec.current_scaling:  # static: the delayed program has no trace of this
    input_scale = compute_scale(lhs_amax, input_scale, spec.fwd_dtype, spec.margin)
    kernel_scale = compute_scale(rhs_amax, kernel_scale, spec.fwd_dtype, spec.margin)
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
  if spec.current_scaling:
    grad_scale = compute_scale(grad_amax, grad_scale, spec.bwd_dtype, spec.margin)
  scale = grad_scale * loss_scale
  q_g = quantize(g, scale, spec.bwd_dtype)
  g, lhs, rhs = (q_g, scale), (q_lhs, input_scale), (q_rhs, kernel_scale)
  d_lhs = _operand_cotangent(g, lhs, rhs, spec.dims, True, spec.lhs_dtype, spec.bwd_precision)
  d_rhs = _operand_cotangent(g, rhs, lhs, spec.dims, False, spec.rhs_dtype, spec.bwd_precision)
  observed = Fp8DotAmax(
    *(_match_varying(a, spec.probe_axes) for a in (lhs_amax, rhs_amax, grad_amax))
  )
  return d_lhs, d_rhs, None, observed, None


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _loss_scale_value(loss_scale: Any) -> jax.Array:
  """A float32 scalar from None, a jmp_lite loss scale, or a number/array."""
  if loss_scale is None:
    return jnp.ones((), _F32)
  if isinstance(loss_scale, LossScale):
    if not loss_scale.uniform:
      # Each stage's gradients carry their own scale, which the matmul cannot know;
      # its own per-tensor gradient scale already adapts to each matmul's range.
      raise TypeError(
        f"fp8 matmuls need the one scale every gradient carries; a {type(loss_scale).__name__} "
        "gives each stage its own. fp8's delayed scaling already scales each matmul's output "
        "gradient on its own: use jl.DynamicLossScale (or jl.NoOpLossScale with bf16) for the "
        "16-bit parts of the network."
      )
    loss_scale = loss_scale.loss_scale
  value = loss_scale
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"loss_scale must be a positive number, got {value!r}.")
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.number) or value.shape != ():
    raise TypeError(
      f"loss_scale must be a scalar number or a jmp_lite loss scale, got {loss_scale!r}."
    )
  return value.astype(_F32)


def _check_operand(x: Any, name: str) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"fp8 {name} must be a floating-point array, got dtype {x.dtype}.")
  if dtypes.is_float8(x.dtype):
    raise ValueError(
      f"fp8 {name} must be in 16 or 32 bits (it is quantized here with its scale), got {x.dtype}."
    )
  return x


def _check_dot_state(state: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
  if not isinstance(state, Fp8DotState):
    raise TypeError(
      f"state must be an Fp8DotState (see init_dot_state), got {type(state).__name__}."
    )
  scales = []
  for name, tensor in zip(Fp8DotState._fields, state, strict=True):
    scale = jnp.asarray(tensor.scale, _F32)
    if scale.shape != ():
      raise ValueError(f"state.{name}.scale must be a scalar, got shape {scale.shape}.")
    scales.append(scale)
  return scales[0], scales[1], scales[2]


def _check_probe(amax: Any) -> Fp8DotAmax:
  if amax is None:
    zero = jnp.zeros((), _F32)
    return Fp8DotAmax(zero, zero, zero)
  if not isinstance(amax, Fp8DotAmax):
    raise TypeError(f"amax must be an Fp8DotAmax (see zeros_amax), got {type(amax).__name__}.")
  return Fp8DotAmax(*(jnp.asarray(a, _F32) for a in amax))


def dot_general(
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  dimension_numbers: Any,
  state: Fp8DotState,
  amax: Fp8DotAmax | None = None,
  *,
  config: Fp8Config | None = None,
  loss_scale: Any = None,
  precision: Any = None,
  preferred_element_type: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  """``lax.dot_general`` with fp8 operands and per-tensor delayed scaling.

  Quantizes ``lhs`` (the input) and ``rhs`` (the kernel) to
  ``config.fwd_dtype`` with ``state.input.scale`` and ``state.kernel.scale``,
  multiplies with fp32 accumulation and rescales; the backward pass quantizes
  the output gradient to ``config.bwd_dtype`` with ``state.output_grad.scale``
  (see the module docstring for the math). The state is read, never written.
  Traced under :func:`current_scaling`, it quantizes each tensor with the scale
  of its own amax instead (see :func:`calibrate`).

  Args:
    lhs, rhs, dimension_numbers: as in :func:`jax.lax.dot_general`; floating
      operands in 16 or 32 bits.
    state: this matmul's :class:`Fp8DotState`.
    amax: a zero :class:`Fp8DotAmax` probe; differentiate with respect to it to
      receive this step's observed amaxes. ``None`` observes nothing (eval).
    config: the fp8 formats (``Fp8Config()`` by default).
    loss_scale: the loss scale the gradients carry (a number, array, or
      jmp_lite loss scale; default 1). The output gradient is quantized with
      ``state.output_grad.scale * loss_scale`` and its amax recorded divided
      by it, so fp8 scaling and loss scaling compose exactly.
    precision: accepted for signature compatibility with ``lax.dot_general``
      (Flax passes it) and ignored: products of fp8 values are exact in fp32,
      and ``config.fast_accumulation`` decides how the GPU sums them.
    preferred_element_type: output dtype (default: the promoted operand
      dtype). Accumulation is fp32 regardless (see ``fast_accumulation``).
    out_sharding: passed to the forward ``lax.dot_general``.

  Returns:
    The product, with gradients flowing to ``lhs`` and ``rhs`` (in their
    dtypes) and the observations to ``amax``.

  >>> state = init_dot_state(Fp8Config(amax_history_length=4))
  >>> x, k = jnp.full((2, 3), 0.5), jnp.full((3, 2), 3.0)
  >>> dot_general(x, k, (((1,), (0,)), ((), ())), state).tolist()
  [[4.5, 4.5], [4.5, 4.5]]
  """
  del precision
  config = _as_config(config)
  lhs = _check_operand(lhs, "lhs")
  rhs = _check_operand(rhs, "rhs")
  dims = _canonical_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
  scales = _check_dot_state(state)
  probe = _check_probe(amax)
  if amax is not None:
    for scope in _current_scaling_scopes.active:
      scope.probed_ops += 1
  if preferred_element_type is None:
    out_dtype = jnp.result_type(lhs, rhs)
  else:
    out_dtype = np.dtype(preferred_element_type)
  # Under shard_map the operands may vary over different mesh axes; like any
  # JAX op the matmul works on their union (the cotangent of an operand that
  # was invariant is then summed over the axes it was broadcast along).
  axes = _varying_axes(lhs) | _varying_axes(rhs)
  lhs, rhs = _vary(lhs, axes - _varying_axes(lhs)), _vary(rhs, axes - _varying_axes(rhs))
  probe_axes = frozenset().union(*(_varying_axes(a) for a in probe))
  probe = Fp8DotAmax(*(_vary(a, probe_axes - _varying_axes(a)) for a in probe))
  spec = _DotSpec(
    dims,
    config.fwd_dtype,
    config.bwd_dtype,
    out_dtype,
    lhs.dtype,
    rhs.dtype,
    out_sharding,
    probe_axes,
    bool(_current_scaling_scopes.active),
    config.margin,
    *_precisions(config),
  )
  return _fp8_dot(lhs, rhs, scales, probe, _loss_scale_value(loss_scale), spec)


# -----------------------------------------------------------------------------
# einsum


def _einsum_subscripts(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
  """Expands ``...`` and the implicit output; returns one letter per axis.

  Ellipsis axes are right-aligned between the operands (NumPy broadcasting);
  an implicit output is the ellipsis followed by the letters used exactly once,
  sorted, as in NumPy.
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
  for spec in (*operands, output):
    letters = spec.replace("...", "", 1)
    if not all(c in string.ascii_letters for c in letters):
      raise ValueError(f"Invalid subscripts {spec!r} in {subscripts!r}: use letters and one '...'.")
  spare = [c for c in string.ascii_letters if c not in eq]
  counts = []
  for spec, ndim, side in ((operands[0], lhs_ndim, "lhs"), (operands[1], rhs_ndim, "rhs")):
    named = len(spec.replace("...", ""))
    n_ellipsis = ndim - named if "..." in spec else 0
    if n_ellipsis < 0 or ("..." not in spec and named != ndim):
      raise ValueError(
        f"Subscripts {spec!r} do not fit the {side} operand of rank {ndim} in {subscripts!r}."
      )
    counts.append(n_ellipsis)
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


@functools.lru_cache(maxsize=256)
def _einsum_plan(subscripts: str, lhs_shape: tuple, rhs_shape: tuple) -> _EinsumPlan:
  lhs, rhs, out = _einsum_subscripts(subscripts, len(lhs_shape), len(rhs_shape))
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


def einsum(
  subscripts: str,
  lhs: jax.typing.ArrayLike,
  rhs: jax.typing.ArrayLike,
  state: Fp8DotState,
  amax: Fp8DotAmax | None = None,
  *,
  config: Fp8Config | None = None,
  loss_scale: Any = None,
  precision: Any = None,
  preferred_element_type: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  """A two-operand einsum computed by one fp8 :func:`dot_general`.

  ``lhs`` is the input and ``rhs`` the kernel for the state's naming. Supports
  contractions, batch indices, outer products, ``...`` and the implicit output
  form; indices repeated within one operand (diagonals) are rejected.
  The other arguments are as in :func:`dot_general`.

  >>> state = init_dot_state(Fp8Config(amax_history_length=4))
  >>> x, k = jnp.ones((2, 3, 4)), jnp.full((4, 5), 0.25)
  >>> einsum("btd,df->bft", x, k, state).shape
  (2, 5, 3)
  """
  lhs = _check_operand(lhs, "lhs")
  rhs = _check_operand(rhs, "rhs")
  plan = _einsum_plan(subscripts, tuple(lhs.shape), tuple(rhs.shape))
  if plan.lhs_sum:
    lhs = jnp.sum(lhs, axis=plan.lhs_sum, dtype=lhs.dtype)
  if plan.rhs_sum:
    rhs = jnp.sum(rhs, axis=plan.rhs_sum, dtype=rhs.dtype)
  transposed = plan.perm != tuple(range(len(plan.perm)))
  out = dot_general(
    lhs,
    rhs,
    plan.dims,
    state,
    amax,
    config=config,
    loss_scale=loss_scale,
    precision=precision,
    preferred_element_type=preferred_element_type,
    out_sharding=None if transposed else out_sharding,
  )
  if not transposed:
    return out
  out = lax.transpose(out, plan.perm)
  if out_sharding is not None:
    out = jax.sharding.reshard(out, out_sharding)
  return out


# -----------------------------------------------------------------------------
# Policy spelling


_RECIPES = {
  "hybrid": (E4M3, E5M2),
  "e4m3": (E4M3, E4M3),
  "e5m2": (E5M2, E5M2),
}


def _recipe_name(config: Fp8Config) -> str:
  for name, formats in _RECIPES.items():
    if formats == (config.fwd_dtype, config.bwd_dtype):
      return name
  return f"{dtypes.dtype_name(config.fwd_dtype)}/{dtypes.dtype_name(config.bwd_dtype)}"


def _parse_recipe(value: str, spec: str) -> tuple[np.dtype, np.dtype] | None:
  value = value.strip().lower()
  if value in ("none", "off"):
    return None
  if value in _RECIPES:
    return _RECIPES[value]
  fwd, sep, bwd = value.partition("/")
  if sep:
    try:
      return (_as_fp8_dtype(fwd.strip(), "fp8 forward format"),
              _as_fp8_dtype(bwd.strip(), "fp8 backward format"))  # fmt: skip
    except (TypeError, ValueError) as e:
      raise ValueError(f"In policy {spec!r}: {e}") from e
  raise ValueError(
    f"Unknown fp8 recipe {value!r} in policy {spec!r}; expected hybrid (e4m3 forward, e5m2 "
    "backward), e4m3, e5m2, none, or forward/backward formats such as f8e4m3/f8e5m2."
  )


@dataclasses.dataclass(frozen=True)
class Fp8Policy:
  """A precision policy plus fp8 matmuls (hashable, jit-static).

  Attributes:
    policy: the dtypes of everything that is not an fp8 matmul (its compute
      dtype is never fp8).
    config: the fp8 recipe for matmuls, or ``None`` for no fp8.

  ``str(p)`` spells it back, e.g. ``"p=f32,c=bf16,o=f32,fp8=hybrid"``; only the
  formats are spelled, the history length, algorithm and margin are not.
  """

  policy: policy_lib.Policy
  config: Fp8Config | None = None

  def __post_init__(self):
    if not isinstance(self.policy, policy_lib.Policy):
      raise TypeError(f"policy must be a jmp_lite Policy, got {type(self.policy).__name__}.")
    if dtypes.is_float8(self.policy.compute_dtype):
      raise ValueError(
        f"Fp8Policy.policy has compute dtype {np.dtype(self.policy.compute_dtype).name}; use a "
        "16/32-bit compute dtype for non-matmul ops and put the fp8 recipe in config."
      )
    if self.config is not None:
      _as_config(self.config)

  def __str__(self) -> str:
    if self.config is None:
      return str(self.policy)
    return f"{self.policy},fp8={_recipe_name(self.config)}"


def get_fp8_policy(spec: str | policy_lib.Policy | Fp8Policy, **config_kwargs: Any) -> Fp8Policy:
  """Parses a policy with fp8 matmuls.

  Two spellings:

  * jmp's grammar plus an ``fp8=`` key: ``"p=f32,c=bf16,o=f32,fp8=hybrid"``
    runs Dense/DenseGeneral/Einsum matmuls in fp8 (E4M3 forward, E5M2
    backward) and everything else as ``p=f32,c=bf16,o=f32``. Recipes:
    ``hybrid``, ``e4m3``, ``e5m2``, ``none``, or ``<fwd>/<bwd>`` dtype names.
    ``"fp8=hybrid"`` alone keeps everything else in float32.
  * an fp8 compute dtype, which :func:`jmp_lite.get_policy` already accepts:
    ``"p=f32,c=f8e4m3"`` means fp8 matmuls with that forward format (E5M2
    backward for E4M3) and everything else in the param dtype.

  Args:
    spec: the string, a :class:`jmp_lite.Policy`, or an :class:`Fp8Policy`
      (returned as is when no ``config_kwargs`` are given).
    **config_kwargs: further :class:`Fp8Config` fields (``amax_history_length``,
      ``amax_compute_algo``, ``margin``).

  >>> str(get_fp8_policy("params=float32, compute=bfloat16, output=float32, fp8=hybrid"))
  'p=f32,c=bf16,o=f32,fp8=hybrid'
  >>> str(get_fp8_policy("p=f32,c=f8e4m3"))
  'p=f32,c=f32,o=f32,fp8=hybrid'
  """
  if isinstance(spec, Fp8Policy):
    if not config_kwargs:
      return spec
    if spec.config is None:
      raise ValueError(f"fp8 options {sorted(config_kwargs)} given for a policy without fp8.")
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, **config_kwargs))
  recipe: tuple[np.dtype, np.dtype] | None = None
  if isinstance(spec, policy_lib.Policy):
    base = spec
  elif isinstance(spec, str):
    parts, fp8_values = [], []
    for part in spec.split(","):
      key, sep, value = part.partition("=")
      if sep and key.strip().lower() == "fp8":
        fp8_values.append(value)
      else:
        parts.append(part)
    if len(fp8_values) > 1:
      raise ValueError(f"Key 'fp8' given twice in policy {spec!r}.")
    if fp8_values:
      recipe = _parse_recipe(fp8_values[0], spec)
    rest = ",".join(parts)
    base = policy_lib.get_policy(rest) if rest.strip() else policy_lib.Policy("f32", "f32", "f32")
  else:
    raise TypeError(
      "get_fp8_policy expects a string such as 'p=f32,c=bf16,o=f32,fp8=hybrid', a Policy or an "
      f"Fp8Policy, got {spec!r} of type {type(spec).__name__}."
    )
  if dtypes.is_float8(base.compute_dtype):
    if recipe is not None:
      raise ValueError(
        f"Policy {spec!r} gives both an fp8 compute dtype and an fp8= recipe; use one of them."
      )
    fwd = _as_fp8_dtype(base.compute_dtype, "compute dtype")
    recipe = (fwd, E5M2)
    base = policy_lib.Policy(base.param_dtype, base.param_dtype, base.output_dtype)
  if recipe is None:
    if config_kwargs:
      raise ValueError(f"fp8 options {sorted(config_kwargs)} given for a policy without fp8.")
    return Fp8Policy(base, None)
  return Fp8Policy(base, Fp8Config(recipe[0], recipe[1], **config_kwargs))


__all__ = (
  "AMAX_COMPUTE_ALGOS",
  "E4M3",
  "E5M2",
  "FAST_ACCUMULATION",
  "CurrentScalingScope",
  "Fp8Config",
  "Fp8DotAmax",
  "Fp8DotState",
  "Fp8Policy",
  "Fp8ScaleState",
  "calibrate",
  "combine_amax",
  "compute_amax",
  "compute_scale",
  "current_scaling",
  "dequantize",
  "dot_general",
  "einsum",
  "get_fp8_policy",
  "init_dot_state",
  "init_scale_state",
  "quantize",
  "quantize_dequantize",
  "reduce_amax",
  "update",
  "update_scale",
  "zeros_amax",
)
