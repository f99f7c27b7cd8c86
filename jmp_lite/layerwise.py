"""Layer-wise adaptive loss scaling (Zhao, Vogel, Ahmed, Luk 2019).

One loss scale for the whole network must keep the stage with the largest
gradients below fp16's maximum, so stages whose gradients are many powers of
two smaller still underflow. Here the model is a chain of *stages*
``f = f_{K-1} o ... o f_0`` and stage ``k`` has its own power-of-two scale
``S_k``:

* The loss is multiplied by ``S_{K-1}``.
* Between stage ``k`` and ``k+1`` sits a *boundary* (:func:`stage_boundary`):
  the identity forward; backward it multiplies the cotangent by
  ``S_k / S_{k+1}``, so stage ``k``'s backward pass runs at scale ``S_k``.
  Both are powers of two, so the conversion is exact.
* Stage ``k``'s parameter gradients are divided by ``S_k``.

Inside a stage one scale holds, so residual branches that merge inside a block
stay consistent. The boundaries also report statistics of the cotangent they
see (max and a histogram of ``floor(log2|g|)``) as the gradient of a zero
"probe" input, so ``jax.grad`` returns them with the gradients: no host sync.

**Scale rule.** Every ``update_period`` finite steps each stage gets

.. math::

  S_k = 2^{\\lfloor \\log_2 (M \\cdot 2^{-m} / a_k) \\rfloor}

where ``a_k`` is the largest true (unscaled) gradient magnitude seen in stage
``k`` (its parameter gradients and the cotangents at its boundaries) over the
last ``amax_history_length`` steps, ``M`` the target format's max (65504 for
fp16) and ``m`` = ``margin_bits`` of headroom: the largest power of two that
would not have overflowed on any of those steps. Among the scales that keep the
underflow fraction of a stage at or below ``underflow_fraction``, this is the
largest one, which also keeps the most mantissa bits for small values
(subnormals lose precision). If even that scale leaves more than
``underflow_fraction`` of the stage's values below the format's smallest
subnormal (the stage's own spread exceeds the format's range), the stage is
flagged in ``underflow_exceeded``. New scales apply from the next step.

On a non-finite step the update is skipped. inf/NaN flows backwards from the
loss, so the stages closer to the loss than the one where the overflow started
stay finite and keep their scales, and the highest non-finite stage is where it
started: its true maximum was at least ``M / S_k``, which enters its history,
so its scale drops by ``2^m`` (at least ``backoff_factor``) and stays there
while the overflow is in the history. The stages below it, which only received
its inf/NaN, back off by ``backoff_factor`` until the next refresh.

Example (plain JAX; see :mod:`jmp_lite.flax` for Flax models)::

  def loss_fn(params, x, y):
    h = x
    for k, layer in enumerate(params):
      h = jnp.tanh(h @ layer["w"])
      if k < len(params) - 1:
        h = jl.stage_boundary(h, k)      # identity outside layer-wise training
    return jnp.mean((h - y) ** 2)

  scale = jl.LayerwiseLossScale(param_stages=[0, 1, 2, 3])  # a prefix of params
  tx = jl.loss_scaling(optax.adam(1e-3), scale)
  loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)
  updates, opt_state = tx.update(grads, opt_state, params)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _transform as transform
from jmp_lite import _tree_util, _validation

HIST_MIN_EXP = -64
"""Exponent of the first histogram bin; smaller magnitudes are counted there."""
HIST_BINS = 128
"""Histogram bins: ``floor(log2|g|)`` from HIST_MIN_EXP to HIST_MIN_EXP + 127."""


class BoundaryStats(NamedTuple):
  """Statistics of the cotangents at the stage boundaries.

  Attributes:
    amax: ``f32[num_stages - 1]``, the largest ``|g|`` seen at each boundary,
      in the units of the stage above it (scale ``S_{k+1}``).
    histogram: ``f32[num_stages - 1, HIST_BINS]``, counts of the nonzero finite
      ``|g|`` by ``floor(log2|g|)``, same units.
  """

  amax: jax.Array
  histogram: jax.Array


class LayerwiseGrads(NamedTuple):
  """Scaled parameter gradients plus boundary statistics, for ``loss_scaling``."""

  grads: Any
  boundary_stats: BoundaryStats


def _log2_histogram(x: jax.Array) -> jax.Array:
  a = jnp.abs(x.astype(jnp.float32)).ravel()
  counted = (a > 0) & jnp.isfinite(a)
  exponent = jnp.frexp(a)[1] - 1  # floor(log2 a) for a > 0
  bins = jnp.clip(exponent - HIST_MIN_EXP, 0, HIST_BINS - 1)
  return jnp.zeros(HIST_BINS, jnp.float32).at[bins].add(counted.astype(jnp.float32))


def _amax(x: jax.Array) -> jax.Array:
  """max |x|, inf if x has a NaN: one pass gives both the statistic and finiteness.

  (``jnp.max`` alone may drop NaN: XLA:CPU's max does.)
  """
  a = jnp.abs(x.astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), initial=0.0)


class _StatsMode(NamedTuple):
  histograms: bool  # log2 histograms on refresh steps
  max_every_step: bool  # the max on every step, not under a conditional


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _boundary(mode, x, ratio, compute_stats, probe_amax, probe_histogram):
  del mode, ratio, compute_stats, probe_amax, probe_histogram
  return x


def _boundary_fwd(mode, x, ratio, compute_stats, probe_amax, probe_histogram):
  del mode, probe_amax, probe_histogram
  return x, (ratio, compute_stats)


def _boundary_bwd(mode, residuals, ct):
  ratio, compute_stats = residuals
  no_histogram = jnp.zeros(HIST_BINS, jnp.float32)
  histogram = (lambda: _log2_histogram(ct)) if mode.histograms else (lambda: no_histogram)
  # The max is one more read of an activation-sized cotangent: on a refresh
  # step only, unless every step is one (then a conditional would only get in
  # the way of XLA's fusion). The histogram is a scatter per value.
  if mode.max_every_step:
    amax = _amax(ct)
    if mode.histograms:
      histogram = lax.cond(compute_stats > 0, histogram, lambda: no_histogram)
    else:
      histogram = no_histogram
  else:
    amax, histogram = lax.cond(
      compute_stats > 0,
      lambda: (_amax(ct), histogram()),
      lambda: (jnp.float32(0), no_histogram),
    )
  # In fp32: the ratio may be outside the cotangent dtype's range; a power of
  # two times a value is exact unless the result leaves the range.
  converted = (ct.astype(jnp.float32) * ratio).astype(ct.dtype)
  return converted, jnp.zeros_like(ratio), jnp.zeros_like(compute_stats), amax, histogram


_boundary.defvjp(_boundary_fwd, _boundary_bwd)


@dataclasses.dataclass(frozen=True)
class _BoundaryContext:
  mode: _StatsMode
  ratios: jax.Array  # S_k / S_{k+1}
  compute_stats: jax.Array
  probes: BoundaryStats


_ACTIVE: contextvars.ContextVar[_BoundaryContext | None] = contextvars.ContextVar(
  "jmp_lite_layerwise_context", default=None
)


@contextlib.contextmanager
def _activate(context: _BoundaryContext):
  token = _ACTIVE.set(context)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def stage_boundary(x: jax.Array, index: int | jax.Array) -> jax.Array:
  """Marks the boundary between stage ``index`` and stage ``index + 1``.

  The identity, except while :func:`jmp_lite.scaled_value_and_grad` computes
  layer-wise scaled gradients: then the backward pass converts the cotangent
  from stage ``index + 1``'s scale to stage ``index``'s and records its
  statistics. ``index`` may be traced (e.g. the iteration of a ``scan`` over a
  stack of layers). Each boundary index should be used once per step.
  """
  context = _ACTIVE.get()
  if context is None:
    return x
  if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"stage_boundary expects a floating-point array, got {type(x).__name__}.")
  num_boundaries = context.ratios.shape[0]
  if isinstance(index, int) and not 0 <= index < num_boundaries:
    raise ValueError(
      f"Boundary index {index} is out of range: with {num_boundaries + 1} stages the "
      f"boundaries are 0..{num_boundaries - 1}."
    )
  return _boundary(
    context.mode,
    x,
    context.ratios[index],
    context.compute_stats,
    context.probes.amax[index],
    context.probes.histogram[index],
  )


class StackedStages(tuple):
  """Stage indices of a stacked parameter, one per index of its leading axis.

  For a scanned stack of layers whose parameters have a leading layer axis:
  ``StackedStages(range(1, 5))`` puts layer i of the stack in stage i + 1.
  """

  def __new__(cls, stages):
    return super().__new__(cls, (int(i) for i in stages))


def _is_spec(x: Any) -> bool:
  return isinstance(x, (int, np.integer, StackedStages)) and not isinstance(x, bool)


def _check_bound(value: Any, name: str, num_stages: int) -> tuple[float, ...]:
  try:
    values = np.broadcast_to(np.asarray(value, np.float64), (num_stages,))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} must be a scalar or one value per stage, got {value!r}.") from e
  if not np.all(np.isfinite(values)) or np.any(values <= 0):
    raise ValueError(f"{name} must be positive and finite, got {value!r}.")
  return tuple(float(v) for v in values)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerwiseLossScale:
  """Per-stage power-of-two loss scales, refreshed from gradient statistics.

  Args:
    param_stages: a pytree with the structure of the parameters whose leaves
      are stage indices: an int, or for a stacked parameter (leading axis = a
      scanned stack of layers) a sequence of ints, one per leading index.
    num_stages: number of stages K (default: 1 + the largest index used).
    initial_scale: the scales of the first step (use powers of two): one for
      every stage, or one per stage; clipped into ``[min_loss_scale,
      max_loss_scale]``.
    update_period: refresh the scales every this many finite steps. The
      maxima of the parameter gradients enter the history on every step (they
      are also the finiteness check); those of the boundary cotangents, one
      more read of an activation-sized tensor each, and the histograms only on
      refresh steps.
    underflow_fraction: the target: at most this fraction of a stage's nonzero
      gradient values may fall below the format's smallest subnormal. 1e-3
      follows the paper's code (their text allows up to 1e-2).
    margin_bits: headroom against overflow, in powers of two below the max.
      Scales are delayed (computed from earlier steps), so gradients that
      grow before the next refresh need room: with 1-2 bits a deep tanh MLP
      trained with Adam (lr 3e-2) overflowed right after refreshes; 3 did not.
    amax_history_length: how many steps of per-stage maxima the rule takes the
      largest of (like fp8 delayed scaling). One step trusts a single batch:
      on a deep tanh MLP that skipped 7-27% of the steps (one batch's gradient
      8x the previous one's); 16 skipped 0-4%. Longer histories react later to
      shrinking gradients.
    gradient_dtype: the format gradients are computed in: ``float16``
      (default) or ``float8_e5m2``.
    min_loss_scale, max_loss_scale: bounds on every stage's scale (scalars or
      one per stage).
    backoff_factor: an overflowing stage's scale is divided by this.
    histograms: also collect log2 histograms of every stage's gradients and
      boundary cotangents on refresh steps, and report the predicted underflow
      fraction per stage (``underflow``, ``underflow_exceeded``). The scale rule
      needs only the maxima; histograms cost a scatter per gradient value
      (+10-20% step time on a CPU MLP at ``update_period=1``), so they are off by
      default.

  State (pytree leaves): ``scales`` (``f32[K]``), ``steps_since_refresh``,
  ``amax_history`` (``f32[amax_history_length, K]``, true max ``|g|`` per
  stage, most recent first; after an overflow the culprit's entry is the lower
  bound ``M / S_k``), and for logging ``amax`` (the history's max at the last
  refresh) and
  ``underflow`` (predicted underflow fraction per stage at the new scales; only
  with ``histograms=True``, zeros otherwise). Built from the configuration when
  not given; ``dataclasses.replace`` keeps it (shapes checked against the new
  configuration).
  """

  uniform: ClassVar[bool] = False  # each stage's gradients carry their own scale

  param_stages: Any
  num_stages: int | None = None
  initial_scale: Any = 2.0**15
  _: dataclasses.KW_ONLY
  update_period: int = 1
  underflow_fraction: float = 1e-3
  margin_bits: int = 3
  amax_history_length: int = 16
  gradient_dtype: Any = "float16"
  min_loss_scale: Any = 1.0
  max_loss_scale: Any = 2.0**64
  backoff_factor: int = 2
  histograms: bool = False
  # State: built from the configuration when omitted; kept by dataclasses.replace.
  scales: jax.Array = None  # type: ignore[assignment]
  steps_since_refresh: jax.Array = None  # type: ignore[assignment]
  amax_history: jax.Array = None  # type: ignore[assignment]
  amax: jax.Array = None  # type: ignore[assignment]
  underflow: jax.Array = None  # type: ignore[assignment]
  # (treedef, leaf specs) of param_stages: hashable, so it can be static pytree data.
  _stage_tree: tuple = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    specs, treedef = jax.tree.flatten(self.param_stages, is_leaf=_is_spec)
    if not specs:
      raise ValueError("param_stages is empty: give a stage index for the parameters.")
    for spec in specs:
      if not _is_spec(spec) or (isinstance(spec, StackedStages) and not spec):
        raise TypeError(
          "param_stages leaves must be int stage indices or StackedStages, got "
          f"{spec!r} ({type(spec).__name__})."
        )
    largest = max(max(spec) if isinstance(spec, StackedStages) else spec for spec in specs)
    num_stages = largest + 1 if self.num_stages is None else self.num_stages
    set_("num_stages", _validation.check_int(num_stages, "num_stages", 1))
    for spec in specs:
      ids = spec if isinstance(spec, StackedStages) else (spec,)
      if min(ids) < 0 or max(ids) >= self.num_stages:
        raise ValueError(f"Stage index in {spec!r} is outside [0, {self.num_stages}).")
    specs = tuple(x if isinstance(x, StackedStages) else int(x) for x in specs)
    set_("_stage_tree", (treedef, specs))
    set_("param_stages", jax.tree.unflatten(treedef, specs))
    set_("update_period", _validation.check_int(self.update_period, "update_period", 1))
    set_("margin_bits", _validation.check_int(self.margin_bits, "margin_bits", 0))
    set_(
      "amax_history_length",
      _validation.check_int(self.amax_history_length, "amax_history_length", 1),
    )
    set_("backoff_factor", _validation.check_int(self.backoff_factor, "backoff_factor", 2))
    if not isinstance(self.histograms, bool):
      raise TypeError(f"histograms must be a bool, got {self.histograms!r}.")
    if not 0 < float(self.underflow_fraction) < 1:
      raise ValueError(f"underflow_fraction must be in (0, 1), got {self.underflow_fraction}.")
    gradient_dtype = dtypes.parse_dtype(self.gradient_dtype)
    if gradient_dtype.name not in ("float16", "float8_e5m2"):
      raise ValueError(f"gradient_dtype must be float16 or float8_e5m2, got {gradient_dtype.name}.")
    set_("gradient_dtype", gradient_dtype)
    low = _check_bound(self.min_loss_scale, "min_loss_scale", self.num_stages)
    high = _check_bound(self.max_loss_scale, "max_loss_scale", self.num_stages)
    if any(lo > hi for lo, hi in zip(low, high, strict=True)):
      raise ValueError(f"min_loss_scale {low} exceeds max_loss_scale {high}.")
    set_("min_loss_scale", low)
    set_("max_loss_scale", high)
    initial = _check_bound(self.initial_scale, "initial_scale", self.num_stages)
    if np.ndim(self.initial_scale) == 0:
      set_("initial_scale", initial[0])
    else:
      set_("initial_scale", initial)
    k = self.num_stages
    initial_state = {
      "scales": lambda: np.clip(initial, low, high).astype(np.float32),
      # The first step computes statistics, so the second already uses them.
      "steps_since_refresh": lambda: np.asarray(self.update_period - 1, np.int32),
      "amax_history": lambda: np.zeros((self.amax_history_length, k), np.float32),
      "amax": lambda: np.zeros((k,), np.float32),
      "underflow": lambda: np.zeros((k,), np.float32),
    }
    for name, make in initial_state.items():
      value = getattr(self, name)
      expected = make()
      if value is None:
        value = expected
      elif np.shape(value) != expected.shape:
        raise ValueError(
          f"{name} must have shape {expected.shape} for this configuration, got {np.shape(value)}."
        )
      set_(name, jnp.asarray(value, expected.dtype))

  # The loss-scale contract (jmp_lite.LossScale) -------------------------------

  @property
  def loss_scale(self) -> jax.Array:
    """The scale the loss is multiplied by: the last stage's (see ``scales``)."""
    return self.scales[-1]

  @property
  def at_minimum(self) -> jax.Array:
    """Whether any stage is pinned at its ``min_loss_scale``."""
    return jnp.any(self.scales <= jnp.asarray(self.min_loss_scale, jnp.float32))

  def scale(self, tree: Any) -> Any:
    """Refuses with more than one stage: a plain ``jax.grad`` cannot scale stages apart.

    The stage boundaries convert between the stages' scales only inside
    :meth:`value_and_grad`; ``jax.grad(lambda p: scale.scale(loss(p)))`` would
    leave them inactive and give every stage the last stage's scale.
    """
    if self.num_stages == 1:
      return _tree_util.scale_tree(tree, self.scales[0])  # one stage, one scale
    raise TypeError(
      "LayerwiseLossScale.scale: layer-wise scaling gives each stage its own scale, which a "
      "plain jax.grad of a scaled loss cannot do (the stage boundaries stay inactive, so every "
      "gradient would carry the last stage's scale and unscaling would be wrong). Take the "
      "gradients with jl.scaled_value_and_grad(loss_fn, opt_state) (or loss_scale.value_and_grad"
      "(loss_fn)), or with jl.flax.TrainState.value_and_grad / jl.flax.Optimizer.value_and_grad."
    )

  def unscale(self, grads: Any) -> Any:
    """Divides each parameter gradient by its stage's scale (in >= fp32).

    Takes what :meth:`value_and_grad` returns (a :class:`LayerwiseGrads`) or
    the parameter gradients alone, and returns the parameter gradients.
    """
    if isinstance(grads, LayerwiseGrads):
      grads = grads.grads
    leaves, treedef = jax.tree.flatten(grads)
    specs = self._leaf_specs(grads)
    return jax.tree.unflatten(
      treedef,
      [self._widen(g) / self._leaf_scale(g, spec) for g, spec in zip(leaves, specs, strict=True)],
    )

  def adjust(self, grads_finite: jax.Array) -> LayerwiseLossScale:
    """Without statistics: on overflow halve every stage, else count the step."""
    finite = _validation.check_predicate(grads_finite, "grads_finite")
    backed = jnp.maximum(self.scales / self.backoff_factor, jnp.asarray(self.min_loss_scale))
    return _tree_util.replace_fields(
      self,
      scales=jnp.where(finite, self.scales, backed.astype(jnp.float32)),
      steps_since_refresh=jnp.where(
        finite,
        jnp.minimum(self.steps_since_refresh + 1, self.update_period - 1),
        self.steps_since_refresh,
      ),
    )

  def with_scales(self, scales: Any) -> LayerwiseLossScale:
    """A copy whose stages have ``scales`` (one per stage) from now on.

    The rest of the state (history, counters) is kept. Use powers of two.

    >>> scale = LayerwiseLossScale([0, 1]).with_scales([2.0**10, 2.0**4])
    >>> scale.scales.tolist()
    [1024.0, 16.0]
    """
    values = jnp.asarray(scales, jnp.float32)
    if values.shape != (self.num_stages,):
      raise ValueError(
        f"scales must have one value per stage, shape ({self.num_stages},); got shape "
        f"{values.shape}."
      )
    if not isinstance(values, jax.core.Tracer):
      low, high = np.asarray(self.min_loss_scale), np.asarray(self.max_loss_scale)
      host = np.asarray(values)
      if not np.all(np.isfinite(host)) or np.any(host < low) or np.any(host > high):
        raise ValueError(
          f"scales must be finite and within [min_loss_scale, max_loss_scale] = "
          f"[{self.min_loss_scale}, {self.max_loss_scale}]; got {host.tolist()}."
        )
    return _tree_util.replace_fields(self, scales=values)

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: Any = 0,
    value_and_grad: Callable[..., Callable[..., Any]] = jax.value_and_grad,
  ) -> Callable[..., tuple[Any, LayerwiseGrads]]:
    """Gradients with stage ``k`` at scale ``S_k``, plus the boundary statistics.

    See :meth:`jmp_lite.LossScale.value_and_grad`. ``argnums`` names one
    argument (the parameters, or an NNX model). The returned gradients are a
    :class:`LayerwiseGrads`.
    """
    if isinstance(argnums, (tuple, list)) or isinstance(argnums, bool):
      raise TypeError(
        "Layer-wise loss scaling differentiates one argument (the params); got "
        f"argnums={argnums!r}."
      )
    scales = self.scales
    context_args = dict(
      mode=_StatsMode(self.histograms, max_every_step=self.update_period == 1),
      ratios=scales[:-1] / scales[1:],
      compute_stats=(self.steps_since_refresh >= self.update_period - 1).astype(jnp.float32),
    )
    num_boundaries = self.num_stages - 1  # type: ignore[operator]  # an int after __post_init__

    def scaled_fun(*args, **kwargs):
      *args, probes = args  # appended last, differentiated too: their gradient is the statistics
      with _activate(_BoundaryContext(probes=probes, **context_args)):
        out = fun(*args, **kwargs)
      value, aux = out if has_aux else (out, None)
      return _tree_util.scale_tree(value, scales[-1]), (value, aux)

    def value_and_scaled_grad(*args, **kwargs):
      probes = BoundaryStats(
        jnp.zeros((num_boundaries,), jnp.float32),
        jnp.zeros((num_boundaries, HIST_BINS), jnp.float32),
      )
      grad_fn = value_and_grad(scaled_fun, argnums=(argnums, len(args)), has_aux=True)
      (_, (value, aux)), (grads, stats) = grad_fn(*args, probes, **kwargs)
      return ((value, aux) if has_aux else value), LayerwiseGrads(grads, stats)

    return value_and_scaled_grad

  def unscale_and_adjust(self, scaled_grads: Any, params: Any = None, *, axis_name: Any = None):
    """Returns (unscaled grads, finite, next state); see the module docstring.

    ``scaled_grads`` must be what :meth:`value_and_grad` returned: gradients
    taken any other way carry no per-stage scales (with a single stage, the
    gradients of ``loss * loss_scale`` are accepted too: there is one scale).
    """
    if isinstance(scaled_grads, LayerwiseGrads):
      scaled_grads, boundary = scaled_grads
    elif self.num_stages == 1:
      boundary = None
    else:
      raise TypeError(
        "A LayerwiseLossScale takes the gradients its own value_and_grad returns (a "
        f"LayerwiseGrads), got {type(scaled_grads).__name__}. Take them with "
        "jl.scaled_value_and_grad(loss_fn, opt_state) (or the Flax TrainState/Optimizer's "
        "value_and_grad): plain jax.grad gradients carry no per-stage scales."
      )
    leaves, treedef = jax.tree.flatten(scaled_grads)
    specs = self._leaf_specs(scaled_grads)
    leaves = [self._widen(g) for g in leaves]
    unscaled = [g / self._leaf_scale(g, spec) for g, spec in zip(leaves, specs, strict=True)]
    grads = _tree_util.cast_like_params(jax.tree.unflatten(treedef, unscaled), params)

    # One max per stage gives the statistic and the finiteness (_amax maps NaN to inf).
    scales = self.scales
    observed = self._observed_amax(leaves, specs, boundary)  # true units
    if axis_name is not None:
      observed = lax.pmax(observed, axis_name)
    stage_finite = jnp.isfinite(observed)
    finite = jnp.all(stage_finite)
    # inf/NaN flows backwards from the loss, so the stage where it started is
    # the non-finite one with the highest index. Its gradients exceeded the
    # format's max at its scale: record that lower bound on its true maximum.
    num_stages = self.num_stages
    highest_non_finite = num_stages - 1 - jnp.argmin(stage_finite[::-1])  # type: ignore[operator]
    culprit = ~finite & (jnp.arange(num_stages) == highest_non_finite)
    fmt_max = dtypes.format_info(self.gradient_dtype).max
    observed = jnp.where(stage_finite, observed, jnp.where(culprit, fmt_max / scales, 0.0))
    history = jnp.concatenate([observed[None], self.amax_history[:-1]])
    amax = jnp.max(history, axis=0)
    new_scales = self._scales_for(amax)

    due = self.steps_since_refresh >= self.update_period - 1
    refresh = due & finite
    if self.histograms:
      underflow = lax.cond(
        refresh,
        lambda: self._predicted_underflow(leaves, specs, boundary, new_scales, axis_name),
        lambda: self.underflow,
      )
    else:
      underflow = self.underflow
    # On overflow the culprit drops to what its history allows (at least one
    # backoff); the stages below it, which only received its inf/NaN, back off
    # once, and the next refresh restores them from their history. Between
    # refreshes the boundaries are not observed, and an overflow in the
    # cotangent a stage passes down shows first in the stage below: the stage
    # above the culprit backs off once too.
    boundaries_seen = due if boundary is not None else jnp.asarray(False)
    unobserved_above = ~boundaries_seen & jnp.concatenate([jnp.zeros(1, bool), culprit[:-1]])
    backed = jnp.where(stage_finite & ~unobserved_above, scales, scales / self.backoff_factor)
    backed = jnp.where(culprit, jnp.minimum(backed, new_scales), backed)
    backed = jnp.maximum(backed, jnp.asarray(self.min_loss_scale, jnp.float32))
    next_state = _tree_util.replace_fields(
      self,
      scales=jnp.where(finite, jnp.where(refresh, new_scales, scales), backed).astype(jnp.float32),
      steps_since_refresh=jnp.where(
        finite & due, 0, jnp.where(finite, self.steps_since_refresh + 1, self.steps_since_refresh)
      ).astype(jnp.int32),
      amax_history=history,
      amax=jnp.where(refresh, amax, self.amax),
      underflow=underflow,
    )
    return grads, finite, next_state

  @property
  def underflow_exceeded(self) -> jax.Array:
    """Stages whose predicted underflow at their scale exceeds the target."""
    return self.underflow > self.underflow_fraction

  # Internals ------------------------------------------------------------------

  @staticmethod
  def _widen(g):
    return jnp.asarray(g, jnp.promote_types(jnp.result_type(g), jnp.float32))

  def _leaf_specs(self, grads) -> list:
    """The stage spec of every gradient leaf (param_stages may be a prefix)."""
    treedef, specs = self._stage_tree
    try:
      per_leaf = jax.tree.map(
        lambda spec, subtree: jax.tree.map(lambda _: spec, subtree),
        jax.tree.unflatten(treedef, specs),
        grads,
        is_leaf=_is_spec,
      )
    except ValueError as e:
      raise ValueError(
        "param_stages must have the structure of the gradients (or be a prefix of it); "
        f"param_stages: {treedef}, gradients: {jax.tree.structure(grads)}."
      ) from e
    return jax.tree.leaves(per_leaf, is_leaf=_is_spec)

  def _leaf_scale(self, g, spec):
    if not isinstance(spec, StackedStages):
      return self.scales[spec]
    if g.ndim == 0 or g.shape[0] != len(spec):
      raise ValueError(
        f"A stacked parameter of shape {g.shape} was given {len(spec)} stage indices; "
        "its leading axis must have one per index."
      )
    return self.scales[jnp.asarray(spec)].reshape((-1,) + (1,) * (g.ndim - 1))

  def _per_stage(self, values, specs, reduce_leaf, combine, identity):
    """Combines a per-leaf (or per-slice) reduction into one value per stage."""
    out = jnp.full((self.num_stages,), identity, jnp.float32)
    for g, spec in zip(values, specs, strict=True):
      if not isinstance(spec, StackedStages):
        out = combine(out.at[spec], reduce_leaf(g))
      else:
        per_slice = jax.vmap(reduce_leaf)(g)
        out = combine(out.at[jnp.asarray(spec)], per_slice)
    return out

  def _observed_amax(self, scaled_leaves, specs, boundary: BoundaryStats | None) -> jax.Array:
    """Largest true (unscaled) gradient magnitude per stage; inf where non-finite."""
    scales = self.scales
    # Parameter gradients are observed at their own stage's scale.
    amax = self._per_stage(scaled_leaves, specs, _amax, lambda ref, v: ref.max(v), 0.0) / scales
    if boundary is not None and self.num_stages > 1:  # type: ignore[operator]  # an int
      # Boundary k is observed at S_{k+1}: an output of stage k+1's backward
      # pass and the input of stage k's.
      b_true = boundary.amax / scales[1:]
      amax = amax.at[:-1].max(b_true).at[1:].max(b_true)
    return amax

  def _scales_for(self, amax: jax.Array) -> jax.Array:
    """The largest powers of two that put ``amax`` ``margin_bits`` below the max."""
    target = dtypes.format_info(self.gradient_dtype).max * 2.0**-self.margin_bits
    # floor(log2(target / amax)), exactly (log2 may round a power of two down)
    # and without overflowing the division: with x = m_x 2^e_x, m_x in [0.5, 1),
    # it is e_t - e_a, minus 1 when m_t < m_a.
    m_t, e_t = jnp.frexp(jnp.float32(target))
    m_a, e_a = jnp.frexp(amax)
    exponent = e_t - e_a - (m_t < m_a).astype(e_a.dtype)
    new = jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), exponent), self.scales)
    new = jnp.clip(new, jnp.asarray(self.min_loss_scale), jnp.asarray(self.max_loss_scale))
    return new.astype(jnp.float32)

  def _predicted_underflow(self, scaled_leaves, specs, boundary, new_scales, axis_name):
    """Fraction of each stage's nonzero values that would underflow at ``new_scales``."""
    log2_scales = jnp.round(jnp.log2(self.scales)).astype(jnp.int32)
    hist = self._per_stage_histogram(scaled_leaves, specs)  # [K, BINS], at S_k
    if boundary is not None and self.num_stages > 1:  # type: ignore[operator]  # an int
      shift_down = log2_scales[:-1] - log2_scales[1:]  # boundary k to stage k's units
      hist = hist.at[1:].add(boundary.histogram)
      hist = hist.at[:-1].add(jax.vmap(_shift_histogram)(boundary.histogram, shift_down))
    if axis_name is not None:
      hist = lax.psum(hist, axis_name)
    # Values below half the smallest subnormal round to zero, i.e.
    # floor(log2|g|) <= log2(min_subnormal) - 2.
    fmt = dtypes.format_info(self.gradient_dtype)
    shift = jnp.round(jnp.log2(new_scales)).astype(jnp.int32) - log2_scales
    shifted = jax.vmap(_shift_histogram)(hist, shift)
    cutoff = int(math.log2(fmt.min_subnormal)) - 2 - HIST_MIN_EXP
    total = jnp.sum(hist, axis=1)
    lost = jnp.sum(shifted[:, : cutoff + 1], axis=1)
    return jnp.where(total > 0, lost / jnp.maximum(total, 1), 0.0)

  def _per_stage_histogram(self, leaves, specs):
    hist = jnp.zeros((self.num_stages, HIST_BINS), jnp.float32)
    for g, spec in zip(leaves, specs, strict=True):
      if not isinstance(spec, StackedStages):
        hist = hist.at[spec].add(_log2_histogram(g))
      else:
        hist = hist.at[jnp.asarray(spec)].add(jax.vmap(_log2_histogram)(g))
    return hist


def _shift_histogram(hist: jax.Array, shift: jax.Array) -> jax.Array:
  """Moves counts ``shift`` bins up (values multiplied by 2^shift); edge bins absorb."""
  destination = jnp.clip(jnp.arange(HIST_BINS) + shift, 0, HIST_BINS - 1)
  return jnp.zeros_like(hist).at[destination].add(hist)


_tree_util.register_dataclass(
  LayerwiseLossScale,
  ("scales", "steps_since_refresh", "amax_history", "amax", "underflow"),
  (
    "_stage_tree",
    "num_stages",
    "initial_scale",
    "update_period",
    "underflow_fraction",
    "margin_bits",
    "amax_history_length",
    "gradient_dtype",
    "min_loss_scale",
    "max_loss_scale",
    "backoff_factor",
    "histograms",
  ),
  # param_stages may hold dicts (unhashable), so the hashable _stage_tree is the aux data.
  rebuild=lambda obj: object.__setattr__(obj, "param_stages", jax.tree.unflatten(*obj._stage_tree)),
)


def check_stages(
  fun: Callable[..., Any],
  loss_scale: Any,
  params: Any,
  *args: Any,
  has_aux: bool = False,
  tolerance: float = 1e-3,
  **kwargs: Any,
) -> None:
  r"""Checks that every parameter's gradient comes from the stage it is assigned to.

  A debugging aid for the plain-JAX API, where nothing else catches a parameter
  used in two stages (tied weights), a tensor that bypasses a boundary (a skip
  connection across stages) or a wrong index in ``param_stages``: each gives
  silently wrong gradients. Compiles the gradient of ``fun(params, *args,
  **kwargs)`` once, runs it a few times to choose scales and then once per
  boundary: a small batch is enough.

  How: the scaled gradient of a parameter of stage :math:`s` is its true
  gradient times :math:`S_s`, and doubling :math:`S_0, \dots, S_j` (the ratio
  at boundary :math:`j`) doubles the part of every gradient that flows through
  boundary :math:`j` and leaves the rest alone. With :math:`\hat g` a scaled
  gradient, :math:`\hat g_j` the same after the doubling and :math:`d` its
  change when every scale doubles (:math:`\hat g` itself, in exact arithmetic),

  .. math::

    \text{share}_j = \langle d, \hat g_j - \hat g \rangle / \|d\|^2

  is 1 for :math:`j \ge s` and 0 for :math:`j < s`; any other share means part
  of the gradient crossed boundaries its stage does not account for. All runs
  execute the same compiled program, and multiplying by a power of two commutes
  with rounding while values stay in the format's normal range, so the shares
  of a correct staging are exactly 0 and 1, in fp16 and bf16 too. To keep the
  values in that range the check picks its own power-of-two scales, not
  ``loss_scale``'s (under which deep stages may underflow): from the loss down,
  each stage's largest boundary cotangent goes 6 powers of two below the max of
  ``loss_scale.gradient_dtype``, lower where a stage overflowed. The shares it
  reports for a wrong staging are measured at these scales (a tensor that
  bypasses a boundary mixes values of two scales, so they depend on them).
  Only values that round to subnormals or zero make a correct share deviate
  from 0 or 1; ``tolerance`` absorbs that, while a wrong stage deviates by 1.

  Args:
    fun: the loss function, differentiated with respect to ``params``.
    loss_scale: a :class:`LayerwiseLossScale`, or an optimizer state holding
      one: its ``param_stages`` are checked; its scales are the first guess.
    params, args, kwargs: what ``fun`` is called with.
    has_aux: ``fun`` returns ``(loss, aux)``.
    tolerance: the largest accepted deviation of a share from 0 or 1, in
      ``[0, 1)``.

  Raises:
    ValueError: naming every parameter (or slice of a stacked one) whose
      gradient does not come from its stage, with the share of it that flows
      through each boundary and the largest deviation; or if the gradients are
      not finite at any scale the check tried.
  """
  scale = transform.get_loss_scale(loss_scale)
  if not isinstance(scale, LayerwiseLossScale):
    raise TypeError(f"check_stages needs a LayerwiseLossScale, got {type(scale).__name__}.")
  if not 0 <= float(tolerance) < 1:
    raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}.")
  num_stages: int = scale.num_stages  # type: ignore[assignment]  # an int after __post_init__
  if num_stages == 1:
    return
  # The boundary maxima on every call: they set the scales.
  mode = _StatsMode(histograms=False, max_every_step=True)
  probes = BoundaryStats(
    jnp.zeros((num_stages - 1,), jnp.float32),
    jnp.zeros((num_stages - 1, HIST_BINS), jnp.float32),
  )

  @jax.jit
  def grads_and_boundary_amax(ratios, top, params):
    def scaled_loss(p, probes):
      with _activate(_BoundaryContext(mode, ratios, jnp.float32(1), probes)):
        out = fun(p, *args, **kwargs)
      return (out[0] if has_aux else out) * top

    grads, stats = jax.grad(scaled_loss, argnums=(0, 1))(params, probes)
    return grads, stats.amax

  def scaled_grads(exps):
    """The scaled gradients and boundary maxima with the scales ``2**exps``."""
    # Only the ratios and the loss's scale enter: the scales themselves need no float32 range.
    ratios = np.ldexp(1.0, exps[:-1] - exps[1:]).astype(np.float32)
    return grads_and_boundary_amax(ratios, np.float32(np.ldexp(1.0, exps[-1])), params)

  target = dtypes.format_info(scale.gradient_dtype).max * 2.0**-_CHECK_HEADROOM_BITS
  exps = np.log2(np.asarray(scale.scales, np.float64))  # a first guess
  exps = np.clip(np.nan_to_num(np.round(exps)), -_CHECK_MAX_EXP, _CHECK_MAX_EXP).astype(np.int64)
  ceiling = np.full(num_stages, np.iinfo(np.int64).max)
  # The search runs with every scale doubled, the most any later run doubles, so
  # that those stay finite too. Once a stage is well scaled, its boundary
  # cotangent scales the stage below: every run fixes at least one more stage.
  for attempt in range(num_stages + 8):
    all_doubled, boundary_amax = scaled_grads(exps + 1)
    specs = scale._leaf_specs(all_doubled)
    fit, finite = _check_stage_fit(all_doubled, specs, boundary_amax, exps + 1, target)
    new = _check_next_exps(fit, finite, exps, ceiling)
    if np.array_equal(new, exps) or attempt == num_stages + 7:
      break
    exps = new
  grads, boundary_amax = scaled_grads(exps)
  finite &= _check_stage_fit(grads, specs, boundary_amax, exps, target)[1]
  if not finite.all():
    raise ValueError(
      "check_stages needs finite gradients, but the backward pass of stages "
      f"{np.flatnonzero(~finite).tolist()} gave inf or NaN at every scale it tried (the last: "
      f"2**{exps.tolist()}). Is the loss finite?"
    )

  # (name, stage, gradient) per parameter, or per slice of a stacked one.
  def rows_of(tree):
    for (path, g), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], specs, strict=True):
      g = np.asarray(g, np.float64)
      if isinstance(spec, StackedStages):
        for index, stage in enumerate(spec):
          yield f"{jax.tree_util.keystr(path)}[{index}]", stage, g[index].ravel()
      else:
        yield jax.tree_util.keystr(path), spec, g.ravel()

  # d, the change when every scale doubles, is g itself but for values that rounded
  # differently near the subnormals. Measured against it, a parameter of stage s sees for
  # j >= s the very computation of its own stage that d saw: its own subnormals cancel.
  rows: list[tuple[str, int, np.ndarray, np.ndarray, list[float]]] = [
    (name, stage, g, g_all - g, [])
    for (name, stage, g), (*_, g_all) in zip(rows_of(grads), rows_of(all_doubled), strict=True)
  ]
  for j in range(num_stages - 1):
    doubled = scaled_grads(exps + (np.arange(num_stages) <= j))[0]
    for (*_, g, d, measured), (*_, g_j) in zip(rows, rows_of(doubled), strict=True):
      norm2 = np.vdot(d, d)
      measured.append(np.vdot(d, g_j - g) / norm2 if norm2 > 0 else 0.0)

  # Enough digits that a share beyond the tolerance never prints as its 0 or 1.
  digits = 17 if tolerance == 0 else min(17, max(4, 2 + math.ceil(-math.log10(tolerance))))
  problems = []
  for name, stage, _, d, share_list in rows:
    if not np.any(d):
      continue  # nothing to attribute (an unused parameter)
    shares = np.asarray(share_list)
    deviation = np.abs(shares - _one_stage_shares(stage, num_stages - 1))
    if np.max(deviation) <= tolerance:
      continue
    shown = ", ".join(f"{j}: {x:.{digits}g}" for j, x in enumerate(shares))
    fits = [
      k
      for k in range(num_stages)
      if np.all(np.abs(shares - _one_stage_shares(k, num_stages - 1)) <= tolerance)
    ]
    hint = f"; it behaves like stage {fits[0]}" if fits else ""
    worst = int(np.argmax(deviation))
    problems.append(
      f"  {name}, assigned to stage {stage}{hint}: {shown}\n"
      f"    largest deviation {deviation[worst]:.{digits}g} (at boundary {worst})"
    )
  if problems:
    raise ValueError(
      "These parameters' gradients do not come from their stage alone. Share of each "
      "gradient through boundaries 0, 1, ... (stage s expects 0 below boundary s, 1 from "
      f"it on; deviations up to {tolerance:g} are accepted):\n" + "\n".join(problems) + "\n"
      "A parameter may be used in two stages, a tensor may bypass a boundary, or "
      "param_stages may be wrong."
    )


_CHECK_HEADROOM_BITS = 6
"""check_stages puts each stage's largest boundary cotangent this many powers of two below the
format's max: one for the doubling, the rest for parameter gradients (sums over the batch) and
values inside a stage larger than those at its boundaries."""
_CHECK_MAX_EXP = 100
"""Bound on |log2| of check_stages's loss scale and of its ratio between adjacent stages."""


def _check_stage_fit(grads, specs, boundary_amax, exps, target):
  """Per stage: the exponent that puts its largest boundary cotangent at most at ``target``
  (NaN when both its boundaries are zero), and whether its backward pass (its parameters'
  gradients and the cotangent it passes down) stayed finite, with the scales ``2**exps``."""
  finite = np.ones(len(exps), bool)
  for g, spec in zip(jax.tree.leaves(grads), specs, strict=True):
    g = np.asarray(g)
    if isinstance(spec, StackedStages):
      if g.ndim == 0 or g.shape[0] != len(spec):
        raise ValueError(
          f"A stacked parameter of shape {g.shape} was given {len(spec)} stage indices; "
          "its leading axis must have one per index."
        )
      for stage, ok in zip(spec, np.isfinite(g.reshape(len(spec), -1)).all(axis=1), strict=True):
        finite[stage] &= ok
    else:
      finite[spec] &= np.isfinite(g).all()
  # Boundary k is observed at 2**exps[k+1], as the output of stage k+1's backward pass and
  # the input of stage k's (_amax maps NaN to inf). Parameter gradients do not enter: those
  # of a tensor that bypasses boundaries mix two scales, which would feed back into the scales.
  b = np.asarray(boundary_amax, np.float64)
  finite[1:] &= np.isfinite(b)
  usable = np.isfinite(b) & (b > 0)
  # floor(log2(target / b)), exactly: frexp gives x = m 2^e with m in [0.5, 1).
  fits_b = np.where(usable, exps[1:] + np.frexp(target / np.where(usable, b, 1.0))[1] - 1, np.nan)
  fit = np.full(len(exps), np.nan)
  fit[:-1] = fits_b
  fit[1:] = np.fmin(fit[1:], fits_b)
  return fit, finite


def _check_next_exps(fit, finite, exps, ceiling) -> np.ndarray:
  """check_stages's next scales (as exponents), from the loss down.

  A stage takes its fit. inf/NaN flows backwards from where it started, the
  highest non-finite stage: its scale drops by 2^4 and stays at most there from
  then on (``ceiling``, updated in place), by 2^16 if no boundary gave it a
  fit. Any other stage without a fit (its boundary cotangents were zero or not
  finite) takes the scale of the stage above, so that the cotangent it
  receives arrives as it was.
  """
  culprit = np.flatnonzero(~finite).max() if not finite.all() else -1
  if culprit >= 0:
    ceiling[culprit] = min(ceiling[culprit], exps[culprit] - 4)
  new = exps.copy()
  for k in reversed(range(len(exps))):
    if not np.isnan(fit[k]):
      new[k] = fit[k]
    elif k == culprit:
      new[k] = exps[k] - 16
    elif k + 1 < len(exps):
      new[k] = new[k + 1]
    new[k] = min(new[k], ceiling[k])
    above = 0 if k + 1 == len(exps) else new[k + 1]
    new[k] = np.clip(new[k], above - _CHECK_MAX_EXP, above + _CHECK_MAX_EXP)
  return new


def _one_stage_shares(stage: int, num_boundaries: int) -> np.ndarray:
  return (np.arange(num_boundaries) >= stage).astype(np.float64)


def stages_from_paths(params: Any, assign: Callable[[tuple], int]) -> Any:
  """Builds ``param_stages`` by calling ``assign(path)`` for every parameter leaf.

  >>> stages_from_paths({"enc": {"w": 0}, "dec": {"w": 0}},
  ...                   lambda path: 0 if path[0].key == "enc" else 1)
  {'dec': {'w': 1}, 'enc': {'w': 0}}
  """
  return jax.tree_util.tree_map_with_path(lambda path, _: assign(path), params)
