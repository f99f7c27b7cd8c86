"""The layer-wise loss scale: its configuration, its state and the loss-scale contract.

The rule itself (the next scales from the gradients' maxima) is in
``_rule.py``; the boundaries that give each stage its scale in
``_boundary.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _tree_util, _validation
from jmp_lite._loss_scale import (
  STATIC,
  Differentiation,
  GradOptions,
  ScaledGrads,
  UserCall,
  checked_field,
  grad_of_scaled_loss,
)
from jmp_lite.layerwise import _rule
from jmp_lite.layerwise._boundary import StatsMode, with_boundaries, zero_probes
from jmp_lite.layerwise._stages import StageTree, check_in_range, leaf_scale, leaf_specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class LayerwiseLossScale:
  r"""Per-stage power-of-two loss scales, refreshed from gradient statistics.

  Stage :math:`k`'s gradients carry its own scale :math:`S_k`: the largest
  power of two that puts the largest gradient of the last
  ``amax_history_length`` steps ``margin_bits`` below the max of
  ``gradient_dtype`` (``docs/layerwise.md`` says how to choose the arguments).

  Args:
    param_stages: a pytree with the parameters' structure (or a prefix of it)
      whose leaves are stage indices: an int, or for a stacked parameter (a
      scanned stack of layers) a :class:`StackedStages`, one per leading index.
    num_stages: number of stages :math:`K` (default: 1 + the largest index).
    initial_scale: the first step's scales (powers of two), one or one per
      stage, clipped into the bounds. Default :math:`2^{15}`.
    update_period: refresh the scales every this many finite steps (default
      1); the boundary maxima and the histograms are taken on refresh steps.
    underflow_fraction: the target fraction of a stage's nonzero gradients
      below the format's smallest subnormal (default ``1e-3``); stages above
      it are flagged in ``underflow_exceeded``.
    margin_bits: headroom below the format's max, in powers of two (default
      3), for gradients that grow before the next refresh.
    amax_history_length: the steps of per-stage maxima the rule takes the
      largest of (default 16): longer skips fewer steps, reacts later.
    gradient_dtype: the gradients' format: ``float16`` (default) or
      ``float8_e5m2``.
    min_loss_scale: the floor of every stage's scale (one or one per stage;
      default 1).
    max_loss_scale: the ceiling (one or one per stage; default :math:`2^{64}`).
    backoff_factor: an overflowing stage's scale is divided by this (an int
      >= 2, default 2).
    histograms: also collect log2 histograms on refresh steps and predict each
      stage's underflow (``underflow``, ``underflow_exceeded``); a scatter per
      value, so off by default.
    scales: state: ``f32[K]``, the current scales (default: ``initial_scale``).
    steps_since_refresh: state: an int32 scalar.
    amax_history: state: ``f32[amax_history_length, K]``, the true max
      :math:`|g|` per stage, most recent first (after an overflow the
      culprit's entry is the lower bound :math:`M / S_k`).
    amax: state, to log: the history's max at the last refresh (``f32[K]``).
    underflow: state, to log: the predicted underflow fraction per stage at
      the new scales (``f32[K]``; zeros unless ``histograms``).

  The constructor checks the configuration and builds the omitted state (the
  leaves); :meth:`replace` keeps it, its shapes checked; JAX's unflattening and
  ``dataclasses.replace`` check nothing. ``param_stages`` becomes a StageTree.
  """

  param_stages: Any = dataclasses.field(metadata=STATIC)
  num_stages: int | None = dataclasses.field(default=None, metadata=STATIC)
  initial_scale: Any = dataclasses.field(default=2.0**15, metadata=STATIC)
  _: dataclasses.KW_ONLY
  update_period: int = dataclasses.field(default=1, metadata=STATIC)
  underflow_fraction: float = dataclasses.field(default=1e-3, metadata=STATIC)
  margin_bits: int = dataclasses.field(default=3, metadata=STATIC)
  amax_history_length: int = dataclasses.field(default=16, metadata=STATIC)
  gradient_dtype: Any = dataclasses.field(default="float16", metadata=STATIC)
  min_loss_scale: Any = dataclasses.field(default=1.0, metadata=STATIC)
  max_loss_scale: Any = dataclasses.field(default=2.0**64, metadata=STATIC)
  backoff_factor: int = dataclasses.field(default=2, metadata=STATIC)
  histograms: bool = dataclasses.field(default=False, metadata=STATIC)
  scales: jax.Array = None  # type: ignore[assignment]
  steps_since_refresh: jax.Array = None  # type: ignore[assignment]
  amax_history: jax.Array = None  # type: ignore[assignment]
  amax: jax.Array = None  # type: ignore[assignment]
  underflow: jax.Array = None  # type: ignore[assignment]
  _checked: bool = checked_field()

  def __post_init__(self):
    if not self._checked:  # a user's construction, not JAX's unflattening
      for name, value in {**_checked_fields(self), "_checked": True}.items():
        object.__setattr__(self, name, value)

  def replace(self, **changes: Any) -> LayerwiseLossScale:
    """A copy with some fields changed, checked as by the constructor; the state is kept.

    Args:
      **changes: new values of fields, by name.

    Returns:
      The new loss scale.
    """
    return dataclasses.replace(self, _checked=False, **changes)

  @property
  def loss_scale(self) -> jax.Array:
    """The scale the loss is multiplied by: the last stage's (see ``scales``)."""
    return self.scales[-1]

  @property
  def gradient_scale(self) -> jax.Array | None:
    """The one stage's scale, or None with several stages (each gradient carries its own)."""
    return self.scales[0] if self.num_stages == 1 else None

  @property
  def at_minimum(self) -> jax.Array:
    """Whether any stage is pinned at its ``min_loss_scale``."""
    return jnp.any(self.scales <= jnp.asarray(self.min_loss_scale, jnp.float32))

  def scale(self, tree: Any) -> Any:
    """Multiplies ``tree`` by ``loss_scale`` (``jax.grad`` of it: every gradient at it).

    Args:
      tree: a loss, or a tree of floating values.

    Returns:
      ``tree`` times ``loss_scale``.
    """
    return _tree_util.scale_tree(tree, self.loss_scale)

  def unscale(self, grads: Any) -> Any:
    """Divides each gradient by the scale it carries (in at least fp32).

    Args:
      grads: what :meth:`value_and_grad` returns (each stage at its scale), or
        a bare tree at ``loss_scale`` (the gradients of :meth:`scale`'s loss).

    Returns:
      The true gradients.
    """
    return _unscaled(self, ScaledGrads.of(grads))[0]

  def adjust(self, grads_finite: jax.Array) -> LayerwiseLossScale:
    """The next state without statistics: on overflow every stage backs off once.

    Args:
      grads_finite: a bool scalar, whether this step's gradients were finite.

    Returns:
      The next scale (a finite step keeps the scales, counting to a refresh).
    """
    finite = _validation.check_predicate(grads_finite, "grads_finite")
    return dataclasses.replace(self, **_rule.back_off(self, finite))

  def with_scales(self, scales: Any) -> LayerwiseLossScale:
    """A copy whose stages have ``scales`` from now on; the history and counters are kept.

    Args:
      scales: one per stage, within the bounds (use powers of two).

    Returns:
      The new loss scale.

    >>> scale = LayerwiseLossScale([0, 1]).with_scales([2.0**10, 2.0**4])
    >>> scale.scales.tolist()
    [1024.0, 16.0]
    """
    return dataclasses.replace(self, scales=_checked_scales(self, scales))

  def value_and_grad(
    self, fun: Callable[..., Any], **options: Unpack[GradOptions]
  ) -> Callable[..., tuple[Any, ScaledGrads]]:
    """Gradients with stage ``k`` at scale ``S_k``, plus the boundary statistics.

    Args:
      fun: returns a loss (``(loss, aux)`` with ``has_aux``); its
        :func:`stage_boundary` calls mark the stages.
      **options: as in :meth:`jmp_lite.LossScale.value_and_grad`
        (:class:`~jmp_lite.GradOptions`), with ``argnums`` one argument
        (``None``: the first).

    Returns:
      A function with ``fun``'s signature returning ``(value, grads)``, ``grads``
      a :class:`~jmp_lite.ScaledGrads` with the boundaries' :class:`BoundaryStats`.
    """
    return _value_and_grad(self, fun, Differentiation.of(options))

  def unscale_and_adjust(
    self, scaled_grads: Any, params: Any = None, *, axis_name: Any = None
  ) -> tuple[Any, jax.Array, LayerwiseLossScale]:
    r"""Unscales the gradients, checks them once and computes the next scales.

    With :math:`\hat g_p` a gradient of stage :math:`k` and :math:`b_k` the
    largest cotangent at boundary :math:`k` (observed at :math:`S_{k+1}`):
    :math:`g_p = \hat g_p / S_k`, and the stage's largest true gradient
    :math:`a_k = \max(\max_{p \in k} |\hat g_p| / S_k, b_{k-1} / S_k,
    b_k / S_{k+1})` (NaN counts as inf) decides finiteness and, through its
    history, the next scales by the rule of :mod:`jmp_lite.layerwise`.

    Args:
      scaled_grads: what :meth:`value_and_grad` returned. A bare tree (the
        gradients of :meth:`scale`'s loss) is taken with one stage only; with
        several it is a TypeError (no boundary statistics to update them).
      params: the true gradients are cast to at least their dtypes and fp32.
      axis_name: the axis whose devices agree (maxima are taken over it).

    Returns:
      ``(grads, finite, next_loss_scale)``, as in
      :meth:`jmp_lite.LossScale.unscale_and_adjust`.
    """
    return _unscale_and_adjust(self, ScaledGrads.of(scaled_grads), params, axis_name)

  @property
  def underflow_exceeded(self) -> jax.Array:
    """Stages whose predicted underflow at their scale exceeds the target (``bool[K]``)."""
    return self.underflow > self.underflow_fraction


_ONE_SCALE_GRADS = (
  "LayerwiseLossScale.unscale_and_adjust with {n} stages got bare gradients (e.g. jax.grad of "
  "loss_scale.scale(loss)), taken without the stage boundaries: they carry no boundary "
  "statistics, so no stage's scale could be updated. Take them with "
  "jl.scaled_value_and_grad(loss_fn, opt_state) (or loss_scale.value_and_grad(loss_fn)), or "
  "with jl.flax.TrainState.value_and_grad / jl.flax.Optimizer.value_and_grad: a "
  "jl.ScaledGrads with each stage at its own scale."
)


def _value_and_grad(
  scale: LayerwiseLossScale, fun: Callable[..., Any], how: Differentiation
) -> Callable[..., tuple[Any, ScaledGrads]]:
  """:meth:`LayerwiseLossScale.value_and_grad`: the loss at ``S_{K-1}``, the boundaries active."""
  has_aux, argnums, value_and_grad = how
  if isinstance(argnums, (tuple, list)) or isinstance(argnums, bool):
    raise TypeError(
      f"Layer-wise loss scaling differentiates one argument (the params); got argnums={argnums!r}."
    )
  scales = scale.scales
  fun_with_probes = with_boundaries(
    fun,
    StatsMode(scale.histograms, max_every_step=scale.update_period == 1),
    scales[:-1] / scales[1:],
    (scale.steps_since_refresh >= scale.update_period - 1).astype(jnp.float32),
  )
  num_boundaries: int = scale.num_stages - 1  # type: ignore[operator]  # an int once built

  def value_and_scaled_grad(*args: Any, **kwargs: Any) -> tuple[Any, ScaledGrads]:
    # The probes are differentiated too: their gradient is the statistics. They come last,
    # or, when the transform picks its own argument (the first), travel with that one.
    scale_loss = lambda value: _tree_util.scale_tree(value, scales[-1])
    probes = zero_probes(num_boundaries)
    if argnums is None:
      with_first = lambda first, *rest, **kw: fun_with_probes(first[0], *rest, first[1], **kw)
      grad_fn = grad_of_scaled_loss(
        with_first,
        scale_loss,
        has_aux=has_aux,
        argnums=None,
        value_and_grad=value_and_grad,
        user_call=UserCall(fun, lambda given: (given[0][0], *given[1:]), None),
      )
      value, (grads, stats) = grad_fn((args[0], probes), *args[1:], **kwargs)
      return value, ScaledGrads(grads, stats)
    grad_fn = grad_of_scaled_loss(
      fun_with_probes,
      scale_loss,
      has_aux=has_aux,
      argnums=(argnums, len(args)),
      value_and_grad=value_and_grad,
      user_call=UserCall(fun, lambda given: given[:-1], argnums),
    )
    value, (grads, stats) = grad_fn(*args, probes, **kwargs)
    return value, ScaledGrads(grads, stats)

  return value_and_scaled_grad


def _unscale_and_adjust(
  scale: LayerwiseLossScale, scaled: ScaledGrads, params: Any, axis_name: Any
) -> tuple[Any, jax.Array, LayerwiseLossScale]:
  """:meth:`LayerwiseLossScale.unscale_and_adjust` of ``scaled``."""
  if scaled.stats is None and scale.num_stages != 1:  # no stage's own scale was observed
    raise TypeError(_ONE_SCALE_GRADS.format(n=scale.num_stages))
  grads, leaves = _unscaled(scale, scaled)
  grads = _tree_util.cast_like_params(grads, params)
  specs = leaf_specs(scale.param_stages, scaled.grads)
  finite, state = _rule.step(scale, leaves, specs, scaled.stats, axis_name)
  return grads, finite, dataclasses.replace(scale, **state)


def _unscaled(scale: LayerwiseLossScale, scaled: ScaledGrads) -> tuple[Any, list[jax.Array]]:
  """(true gradients, the scaled leaves widened to at least fp32).

  Without ``stats`` every gradient carries ``loss_scale``; with them, its stage's scale.
  """
  leaves, treedef = jax.tree.flatten(scaled.grads)
  leaves = [jnp.asarray(g, jnp.promote_types(jnp.result_type(g), jnp.float32)) for g in leaves]
  if scaled.stats is None:
    unscaled = [g / scale.loss_scale for g in leaves]
  else:
    specs = leaf_specs(scale.param_stages, scaled.grads)
    unscaled = [g / leaf_scale(scale.scales, g, s) for g, s in zip(leaves, specs, strict=True)]
  return jax.tree.unflatten(treedef, unscaled), leaves


def _checked_fields(scale: LayerwiseLossScale) -> dict[str, Any]:
  """Every field of a new ``scale``, checked and normalized; the state built if omitted."""
  stages = scale.param_stages
  stages = stages if isinstance(stages, StageTree) else StageTree(stages)
  k = _validation.check_int(
    stages.largest + 1 if scale.num_stages is None else scale.num_stages, "num_stages", 1
  )
  check_in_range(stages.specs, k)
  check_int = _validation.check_int
  config: dict[str, Any] = {
    "num_stages": k,
    "param_stages": stages,
    "update_period": check_int(scale.update_period, "update_period", 1),
    "margin_bits": check_int(scale.margin_bits, "margin_bits", 0),
    "amax_history_length": check_int(scale.amax_history_length, "amax_history_length", 1),
    "backoff_factor": check_int(scale.backoff_factor, "backoff_factor", 2),
    "histograms": _validation.check_bool(scale.histograms, "histograms"),
  }
  fraction = _validation.as_real(scale.underflow_fraction, "underflow_fraction", "in (0, 1)")
  if not 0 < fraction < 1:
    raise ValueError(f"underflow_fraction must be in (0, 1), got {fraction}.")
  config["underflow_fraction"] = fraction
  config["gradient_dtype"] = _validation.check_dtype(
    scale.gradient_dtype,
    "gradient_dtype",
    lambda d: d.name in ("float16", "float8_e5m2"),
    "float16 or float8_e5m2",
  )
  bounds = lambda name: _validation.as_bounds(getattr(scale, name), name, k, np.dtype(np.float32))
  low, high = bounds("min_loss_scale"), bounds("max_loss_scale")
  if any(lo > hi for lo, hi in zip(low, high, strict=True)):
    raise ValueError(f"min_loss_scale {low} exceeds max_loss_scale {high}.")
  config["min_loss_scale"], config["max_loss_scale"] = low, high
  initial = bounds("initial_scale")
  config["initial_scale"] = initial[0] if np.ndim(scale.initial_scale) == 0 else initial
  return config | _checked_state(scale, config, np.clip(initial, low, high))


def _checked_state(scale: LayerwiseLossScale, config: dict[str, Any], initial: Any) -> dict:
  """The state fields of a new ``scale`` (from ``config`` if omitted), their shapes checked."""
  k = config["num_stages"]
  initial_state = {
    "scales": np.asarray(initial, np.float32),
    # The first step computes statistics, so the second already uses them.
    "steps_since_refresh": np.asarray(config["update_period"] - 1, np.int32),
    "amax_history": np.zeros((config["amax_history_length"], k), np.float32),
    "amax": np.zeros((k,), np.float32),
    "underflow": np.zeros((k,), np.float32),
  }
  state = {}
  for name, expected in initial_state.items():
    value = getattr(scale, name)
    if value is None:
      value = expected
    elif np.shape(value) != expected.shape:
      raise ValueError(
        f"{name} must have shape {expected.shape} for this configuration, got {np.shape(value)}."
      )
    state[name] = jnp.asarray(value, expected.dtype)
  return state


def _checked_scales(scale: LayerwiseLossScale, scales: Any) -> jax.Array:
  """``scales`` as ``f32[K]``, checked against ``scale``'s bounds when concrete."""
  values = jnp.asarray(scales, jnp.float32)
  if values.shape != (scale.num_stages,):
    raise ValueError(
      f"scales must have one value per stage, shape ({scale.num_stages},); got shape "
      f"{values.shape}."
    )
  if _validation.is_concrete(values):
    low, high = np.asarray(scale.min_loss_scale), np.asarray(scale.max_loss_scale)
    host = np.asarray(values)
    if not np.all(np.isfinite(host)) or np.any(host < low) or np.any(host > high):
      raise ValueError(
        f"scales must be finite and within [min_loss_scale, max_loss_scale] = "
        f"[{scale.min_loss_scale}, {scale.max_loss_scale}]; got {host.tolist()}."
      )
  return values
