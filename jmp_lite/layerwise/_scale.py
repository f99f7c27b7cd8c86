"""The layer-wise loss scale: its configuration, its state and the loss-scale contract.

The rule itself (the next scales from the gradients' maxima) is in
``_rule.py``; the boundaries that give each stage its scale in
``_boundary.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _tree_util, _validation
from jmp_lite._loss_scale import ValueAndGradTransform, grad_of_scaled_loss
from jmp_lite._tree_util import DERIVED, STATIC
from jmp_lite.layerwise import _rule
from jmp_lite.layerwise._boundary import BoundaryStats, StatsMode, with_boundaries, zero_probes
from jmp_lite.layerwise._stages import (
  Spec,
  check_in_range,
  flatten_stages,
  leaf_scale,
  leaf_specs,
)


class LayerwiseGrads(NamedTuple):
  """Scaled parameter gradients plus boundary statistics, for ``loss_scaling``.

  What :meth:`LayerwiseLossScale.value_and_grad` returns as the gradients.

  Attributes:
    grads: the parameter gradients, each at its stage's scale.
    boundary_stats: the statistics of the cotangents at the stage boundaries.
  """

  grads: Any
  boundary_stats: BoundaryStats


def _restore_param_stages(scale: Any) -> None:
  # param_stages may hold dicts (unhashable), so the hashable _stage_tree is the aux data.
  object.__setattr__(scale, "param_stages", jax.tree.unflatten(*scale._stage_tree))


@functools.partial(_tree_util.register_dataclass, rebuild=_restore_param_stages)
@dataclasses.dataclass(frozen=True, eq=False)
class LayerwiseLossScale:
  r"""Per-stage power-of-two loss scales, refreshed from gradient statistics.

  Stage :math:`k`'s gradients carry its own scale :math:`S_k`; every
  ``update_period`` finite steps each stage gets the largest power of two that
  puts the largest gradient of the last ``amax_history_length`` steps
  ``margin_bits`` below the max of ``gradient_dtype`` (see
  :meth:`unscale_and_adjust`, and ``docs/layerwise.md`` for how to choose the
  arguments).

  Args:
    param_stages: a pytree with the structure of the parameters (or a prefix
      of it) whose leaves are stage indices: an int, or for a stacked
      parameter (leading axis = a scanned stack of layers) a
      :class:`StackedStages`, one index per leading index.
    num_stages: number of stages :math:`K` (default: 1 + the largest index
      used).
    initial_scale: the scales of the first step (use powers of two): one for
      every stage, or one per stage; clipped into ``[min_loss_scale,
      max_loss_scale]``. Default :math:`2^{15}`.
    update_period: refresh the scales every this many finite steps (default
      1). The maxima of the parameter gradients enter the history on every
      step (they are also the finiteness check); those of the boundary
      cotangents and the histograms only on refresh steps.
    underflow_fraction: the target: at most this fraction of a stage's nonzero
      gradient values may fall below the format's smallest subnormal (default
      ``1e-3``); stages above it are flagged in ``underflow_exceeded``.
    margin_bits: headroom against overflow, in powers of two below the
      format's max (default 3): the scales are computed from earlier steps, so
      gradients that grow before the next refresh need room.
    amax_history_length: how many steps of per-stage maxima the rule takes the
      largest of, like fp8 delayed scaling (default 16). Longer histories skip
      fewer steps and react later to shrinking gradients.
    gradient_dtype: the format gradients are computed in: ``float16``
      (default) or ``float8_e5m2``.
    min_loss_scale: lower bound on every stage's scale (a scalar or one per
      stage; default 1).
    max_loss_scale: upper bound on every stage's scale (a scalar or one per
      stage; default :math:`2^{64}`).
    backoff_factor: an overflowing stage's scale is divided by this (an int
      >= 2, default 2).
    histograms: also collect log2 histograms of every stage's gradients and
      boundary cotangents on refresh steps, and report the predicted underflow
      fraction per stage (``underflow``, ``underflow_exceeded``). The rule
      needs only the maxima, and a histogram costs a scatter per value: off
      by default.
    scales: state: ``f32[K]``, the current scales (default: from
      ``initial_scale``).
    steps_since_refresh: state: an int32 scalar.
    amax_history: state: ``f32[amax_history_length, K]``, the true max
      :math:`|g|` per stage, most recent first; after an overflow the
      culprit's entry is the lower bound :math:`M / S_k`.
    amax: state, for logging: the history's max at the last refresh
      (``f32[K]``).
    underflow: state, for logging: the predicted underflow fraction per stage
      at the new scales (``f32[K]``; zeros unless ``histograms``).

  The state (the pytree's leaves) is built from the configuration when not
  given; ``dataclasses.replace`` keeps it, its shapes checked.
  """

  uniform: ClassVar[bool] = False  # each stage's gradients carry their own scale

  param_stages: Any = dataclasses.field(metadata=DERIVED)
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
  # State: built from the configuration when omitted; kept by dataclasses.replace.
  scales: jax.Array = None  # type: ignore[assignment]
  steps_since_refresh: jax.Array = None  # type: ignore[assignment]
  amax_history: jax.Array = None  # type: ignore[assignment]
  amax: jax.Array = None  # type: ignore[assignment]
  underflow: jax.Array = None  # type: ignore[assignment]
  # (treedef, leaf specs) of param_stages: hashable, so it can be static pytree data.
  _stage_tree: tuple = dataclasses.field(init=False, repr=False, metadata=STATIC)

  def __post_init__(self):
    for name, value in _checked_fields(self).items():
      object.__setattr__(self, name, value)

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
    """Scales ``tree`` with a single stage; refuses with more.

    The stage boundaries convert between the stages' scales only inside
    :meth:`value_and_grad`; ``jax.grad(lambda p: scale.scale(loss(p)))`` would
    leave them inactive and give every stage the last stage's scale.

    Args:
      tree: a loss, or a tree of floating values.

    Returns:
      ``tree`` times the one stage's scale.

    Raises:
      TypeError: with more than one stage.
    """
    if self.num_stages == 1:
      return _tree_util.scale_tree(tree, self.scales[0])  # one stage, one scale
    raise TypeError(_NO_PLAIN_GRAD)

  def unscale(self, grads: Any) -> Any:
    """Divides each parameter gradient by its stage's scale (in at least fp32).

    Args:
      grads: what :meth:`value_and_grad` returns (a :class:`LayerwiseGrads`)
        or the parameter gradients alone.

    Returns:
      The true parameter gradients.
    """
    if isinstance(grads, LayerwiseGrads):
      grads = grads.grads
    return _unscaled(self, grads)[0]

  def adjust(self, grads_finite: jax.Array) -> LayerwiseLossScale:
    """The next state without statistics: on overflow every stage backs off once.

    Args:
      grads_finite: a bool scalar, whether this step's gradients were finite.

    Returns:
      The scale for the next step: on a finite step the scales are kept and
      the step counts towards the next refresh.
    """
    finite = _validation.check_predicate(grads_finite, "grads_finite")
    return _tree_util.replace_fields(self, **_rule.back_off(self, finite))

  def with_scales(self, scales: Any) -> LayerwiseLossScale:
    """A copy whose stages have ``scales`` from now on; the history and counters are kept.

    Args:
      scales: one scale per stage, within ``[min_loss_scale,
        max_loss_scale]`` (use powers of two).

    Returns:
      The new loss scale.

    >>> scale = LayerwiseLossScale([0, 1]).with_scales([2.0**10, 2.0**4])
    >>> scale.scales.tolist()
    [1024.0, 16.0]
    """
    return _tree_util.replace_fields(self, scales=_checked_scales(self, scales))

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: Any = None,
    value_and_grad: ValueAndGradTransform = jax.value_and_grad,
  ) -> Callable[..., tuple[Any, LayerwiseGrads]]:
    """Gradients with stage ``k`` at scale ``S_k``, plus the boundary statistics.

    Args:
      fun: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``); its
        :func:`stage_boundary` calls mark the stages.
      has_aux: as in :func:`jax.value_and_grad`.
      argnums: the one argument to differentiate (the parameters, or an NNX
        model), in the form ``value_and_grad`` takes; ``None`` (default): the
        first, and ``argnums`` is not passed (``eqx.filter_value_and_grad``).
      value_and_grad: the differentiation transform, with
        :func:`jax.value_and_grad`'s signature.

    Returns:
      A function with ``fun``'s signature returning ``(value, grads)``:
      ``value`` is ``fun``'s own, ``grads`` a :class:`LayerwiseGrads`.
    """
    return _value_and_grad(self, fun, has_aux, argnums, value_and_grad)

  def unscale_and_adjust(
    self, scaled_grads: Any, params: Any = None, *, axis_name: Any = None
  ) -> tuple[Any, jax.Array, LayerwiseLossScale]:
    r"""Unscales the gradients, checks them once and computes the next scales.

    With :math:`\hat g_p` the gradient of a parameter of stage :math:`k`
    (scaled by :math:`S_k`) and :math:`b_k` the largest cotangent at boundary
    :math:`k` (observed at :math:`S_{k+1}`), the true gradients and each
    stage's largest true gradient of this step are

    .. math::

      g_p = \hat g_p / S_k, \qquad
      a_k = \max\left(\max_{p \in k} |\hat g_p| / S_k,\;
        b_{k-1} / S_k,\; b_k / S_{k+1}\right)

    (NaN counts as inf). The step is finite when every :math:`a_k` is. Then,
    on a refresh step (every ``update_period`` finite steps),

    .. math::

      S_k \leftarrow \operatorname{clip}\left(
        2^{\lfloor \log_2 (M \cdot 2^{-m} / \max_{i < H} a_k^{(t-i)}) \rfloor},
        S_{\min}, S_{\max}\right)

    with :math:`M` the max of ``gradient_dtype``, :math:`m` ``margin_bits``
    and :math:`H` ``amax_history_length``; between refreshes the scales are
    kept. On a non-finite step inf/NaN has flowed backwards from the stage
    where it started, :math:`c`, the highest non-finite one: its history
    records :math:`a_c = M / S_c` and it drops to
    :math:`\min(S_c / \beta, \text{the rule's scale})`; the stages below it
    divide their scale by :math:`\beta` (``backoff_factor``), and so does the
    stage above it on a step whose boundaries were not observed. No scale
    goes below :math:`S_{\min}`.

    Args:
      scaled_grads: what :meth:`value_and_grad` returned (a
        :class:`LayerwiseGrads`). Gradients taken any other way carry no
        per-stage scales; with a single stage, the gradients of ``loss *
        loss_scale`` are accepted too.
      params: the parameters; the true gradients are cast to at least fp32
        and at least their dtypes (``None``: to at least fp32).
      axis_name: under ``shard_map``/``pmap``, the axis whose devices must
        agree (the maxima, and so the scales, are taken over it).

    Returns:
      ``(grads, finite, next_loss_scale)``: the true gradients with the
      parameters' structure, whether all of them are finite (a bool scalar),
      and the loss scale for the next step.
    """
    scaled_grads, boundary = _split(self, scaled_grads)
    grads, leaves, specs = _unscaled(self, scaled_grads)
    grads = _tree_util.cast_like_params(grads, params)
    finite, state = _rule.step(self, leaves, specs, boundary, axis_name)
    return grads, finite, _tree_util.replace_fields(self, **state)

  @property
  def underflow_exceeded(self) -> jax.Array:
    """Stages whose predicted underflow at their scale exceeds the target (``bool[K]``)."""
    return self.underflow > self.underflow_fraction


_NO_PLAIN_GRAD = (
  "LayerwiseLossScale.scale: layer-wise scaling gives each stage its own scale, which a "
  "plain jax.grad of a scaled loss cannot do (the stage boundaries stay inactive, so every "
  "gradient would carry the last stage's scale and unscaling would be wrong). Take the "
  "gradients with jl.scaled_value_and_grad(loss_fn, opt_state) (or loss_scale.value_and_grad"
  "(loss_fn)), or with jl.flax.TrainState.value_and_grad / jl.flax.Optimizer.value_and_grad."
)


def _value_and_grad(
  scale: LayerwiseLossScale,
  fun: Callable[..., Any],
  has_aux: bool,
  argnums: Any,
  value_and_grad: ValueAndGradTransform,
) -> Callable[..., tuple[Any, LayerwiseGrads]]:
  """:meth:`LayerwiseLossScale.value_and_grad`: the loss at ``S_{K-1}``, the boundaries active."""
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

  def value_and_scaled_grad(*args: Any, **kwargs: Any) -> tuple[Any, LayerwiseGrads]:
    # The probes are differentiated too: their gradient is the statistics. They come last,
    # or, when the transform picks its own argument (the first), travel with that one.
    scale_loss = lambda value: _tree_util.scale_tree(value, scales[-1])
    probes = zero_probes(num_boundaries)
    if argnums is None:
      with_first = lambda first, *rest, **kw: fun_with_probes(first[0], *rest, first[1], **kw)
      grad_fn = grad_of_scaled_loss(
        with_first, scale_loss, has_aux=has_aux, argnums=None, value_and_grad=value_and_grad
      )
      value, (grads, stats) = grad_fn((args[0], probes), *args[1:], **kwargs)
      return value, LayerwiseGrads(grads, stats)
    grad_fn = grad_of_scaled_loss(
      fun_with_probes,
      scale_loss,
      has_aux=has_aux,
      argnums=(argnums, len(args)),
      value_and_grad=value_and_grad,
    )
    value, (grads, stats) = grad_fn(*args, probes, **kwargs)
    return value, LayerwiseGrads(grads, stats)

  return value_and_scaled_grad


def _split(scale: LayerwiseLossScale, scaled_grads: Any) -> tuple[Any, BoundaryStats | None]:
  """(parameter gradients, boundary statistics) of what ``unscale_and_adjust`` was given."""
  if isinstance(scaled_grads, LayerwiseGrads):
    return scaled_grads.grads, scaled_grads.boundary_stats
  if scale.num_stages == 1:
    return scaled_grads, None
  raise TypeError(
    "A LayerwiseLossScale takes the gradients its own value_and_grad returns (a "
    f"LayerwiseGrads), got {type(scaled_grads).__name__}. Take them with "
    "jl.scaled_value_and_grad(loss_fn, opt_state) (or the Flax TrainState/Optimizer's "
    "value_and_grad): plain jax.grad gradients carry no per-stage scales."
  )


def _unscaled(
  scale: LayerwiseLossScale, scaled_grads: Any
) -> tuple[Any, list[jax.Array], Sequence[Spec]]:
  """(true gradients, the scaled leaves widened to at least fp32, their specs)."""
  leaves, treedef = jax.tree.flatten(scaled_grads)
  specs = leaf_specs(scale.param_stages, scaled_grads)
  leaves = [jnp.asarray(g, jnp.promote_types(jnp.result_type(g), jnp.float32)) for g in leaves]
  unscaled = [g / leaf_scale(scale.scales, g, spec) for g, spec in zip(leaves, specs, strict=True)]
  return jax.tree.unflatten(treedef, unscaled), leaves, specs


def _checked_fields(scale: LayerwiseLossScale) -> dict[str, Any]:
  """Every field of a new ``scale``, checked and normalized; the state built if omitted."""
  treedef, specs, largest = flatten_stages(scale.param_stages)
  k = _validation.check_int(
    largest + 1 if scale.num_stages is None else scale.num_stages, "num_stages", 1
  )
  check_in_range(specs, k)
  check_int = _validation.check_int
  config: dict[str, Any] = {
    "num_stages": k,
    "_stage_tree": (treedef, specs),
    "param_stages": jax.tree.unflatten(treedef, specs),
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
  initial_state = {
    "scales": np.clip(initial, low, high).astype(np.float32),
    # The first step computes statistics, so the second already uses them.
    "steps_since_refresh": np.asarray(config["update_period"] - 1, np.int32),
    "amax_history": np.zeros((config["amax_history_length"], k), np.float32),
    "amax": np.zeros((k,), np.float32),
    "underflow": np.zeros((k,), np.float32),
  }
  for name, expected in initial_state.items():
    value = getattr(scale, name)
    if value is None:
      value = expected
    elif np.shape(value) != expected.shape:
      raise ValueError(
        f"{name} must have shape {expected.shape} for this configuration, got {np.shape(value)}."
      )
    config[name] = jnp.asarray(value, expected.dtype)
  return config


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
