"""Delayed scaling: the scale state of fp8 tensors and the rules that update it (private)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite._fp8_config import (
  AMAX_COMPUTE_ALGOS,
  F32,
  Fp8Config,
  as_config,
  as_fp8_dtype,
  check_margin,
)


class Fp8ScaleState(NamedTuple):
  r"""Delayed-scaling state of one tensor: :math:`x \approx s \cdot q`.

  Attributes:
    scale: float32 scalar :math:`s`, the value of one fp8 unit. It is the scale
      the *next* step quantizes with.
    amax_history: float32 ``[L]``, the observed absolute maxima, most recent
      first (index 0), oldest last.
  """

  scale: jax.Array
  amax_history: jax.Array


class Fp8DotState(NamedTuple):
  """Scales of one fp8 matmul: its input (lhs), kernel (rhs) and output gradient.

  Attributes:
    input: the :class:`Fp8ScaleState` of the left operand.
    kernel: the :class:`Fp8ScaleState` of the right operand.
    output_grad: the :class:`Fp8ScaleState` of the gradient of the output.
  """

  input: Fp8ScaleState
  kernel: Fp8ScaleState
  output_grad: Fp8ScaleState


class Fp8DotAmax(NamedTuple):
  """What one matmul observed in a step: the amax of each of its tensors.

  Passed into :func:`dot_general` as zeros (the "probe"); its gradient holds
  the observations.

  Attributes:
    input: float32 ``max |lhs|``.
    kernel: float32 ``max |rhs|``.
    output_grad: float32 ``max |g|`` of the output gradient, in unscaled units
      (divided by the loss scale).
  """

  input: jax.Array
  kernel: jax.Array
  output_grad: jax.Array


def init_scale_state(amax_history_length: int = 1024) -> Fp8ScaleState:
  """No scale yet (0) and an all-zero history.

  A scale of 0 means "none yet": the matmul quantizes such a tensor with its
  own amax (current scaling), and :func:`update_scale` keeps it at 0 until an
  observation is nonzero, so a fresh state's first step cannot flush or
  saturate silently. :func:`calibrate` sets the scales from a first batch
  before training instead.

  Args:
    amax_history_length: the history length :math:`L` (>= 1).

  Returns:
    The initial :class:`Fp8ScaleState`.

  >>> init_scale_state(2)
  Fp8ScaleState(scale=Array(0., dtype=float32), amax_history=Array([0., 0.], dtype=float32))
  """
  length = _validation.check_int(amax_history_length, "amax_history_length", 1)
  return Fp8ScaleState(jnp.zeros((), F32), jnp.zeros((length,), F32))


def init_dot_state(config: Fp8Config | None = None) -> Fp8DotState:
  """The initial :class:`Fp8DotState` of one matmul.

  Args:
    config: the history length comes from it (``Fp8Config()`` by default).

  Returns:
    An :class:`Fp8DotState` of three :func:`init_scale_state`.
  """
  length = as_config(config).amax_history_length
  return Fp8DotState(*(init_scale_state(length) for _ in Fp8DotState._fields))


def _is_dot_state(x: Any) -> bool:
  return isinstance(x, Fp8DotState)


def zeros_amax(state: Any) -> Any:
  """The amax probes for a pytree of :class:`Fp8DotState`: each replaced by zeros.

  Differentiate the loss with respect to these (``argnums``) to collect the
  observations :func:`update` needs.

  Args:
    state: any pytree whose fp8 nodes are :class:`Fp8DotState`.

  Returns:
    The same structure with an :class:`Fp8DotAmax` of zeros for each
    :class:`Fp8DotState`, shaped like its scales (so stacked states, e.g. the
    layers of ``nn.scan``, get stacked probes).

  >>> zeros_amax({"dense": init_dot_state()})["dense"].kernel
  Array(0., dtype=float32)
  """

  def probe(dot_state: Any) -> Fp8DotAmax:
    if not isinstance(dot_state, Fp8DotState):
      raise TypeError(f"Expected Fp8DotState nodes in the state, found {type(dot_state).__name__}.")
    return Fp8DotAmax(*(jnp.zeros(jnp.shape(t.scale), F32) for t in dot_state))

  return jax.tree.map(probe, state, is_leaf=_is_dot_state)


def compute_scale(
  amax: jax.typing.ArrayLike,
  previous_scale: jax.typing.ArrayLike,
  dtype: Any,
  margin: float = 0.0,
) -> jax.Array:
  r"""The scale that maps ``amax * 2**margin`` to the largest value of ``dtype``.

  .. math:: s = \frac{A \cdot 2^{\text{margin}}}{\text{fp8\_max}}

  Keeps ``previous_scale`` when ``amax`` is zero, negative or non-finite (no
  information: an all-zero tensor, or an overflow), and when the new scale
  would underflow to zero or overflow float32.

  Args:
    amax: :math:`A`, the absolute maximum to cover.
    previous_scale: the scale to keep when :math:`A` says nothing.
    dtype: the fp8 format (its largest value is :math:`\text{fp8\_max}`).
    margin: extra headroom in powers of two (>= 0).

  Returns:
    A float32 scale, shaped like ``amax`` and ``previous_scale`` broadcast.

  >>> float(compute_scale(896.0, 1.0, "float8_e4m3fn"))
  2.0
  """
  fp8_max = dtypes.FORMATS[as_fp8_dtype(dtype, "dtype").name].max
  margin = check_margin(margin)
  amax = jnp.asarray(amax, F32)
  previous_scale = jnp.asarray(previous_scale, F32)
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
  r"""Pushes one observed amax into the history and recomputes the scale.

  .. math::

    h \leftarrow (a_t, h_0, \dots, h_{L-2}), \qquad
    s \leftarrow \texttt{compute\_scale}(\max_i h_i \text{ or } h_0,\ s,\ \text{dtype},
    \ \text{margin})

  A non-finite observation :math:`a_t` (an overflowed step) is dropped: the
  history and scale are unchanged. Pushing it would pin the ``"max"`` rule to
  inf, which keeps the old scale, for :math:`L` steps.

  Args:
    state: the tensor's :class:`Fp8ScaleState`; stacked states (``scale`` of
      shape ``[...]``, ``amax_history`` of shape ``[..., L]``, e.g. the layers
      of ``nn.scan``) update elementwise.
    amax: :math:`a_t`, shaped like ``state.scale``.
    dtype: the tensor's fp8 format.
    margin: extra headroom in powers of two (>= 0).
    amax_compute_algo: ``"max"`` (:math:`\max_i h_i`) or ``"most_recent"``
      (:math:`h_0`).

  Returns:
    The new :class:`Fp8ScaleState`.

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
  r"""Max of the observations across a ``shard_map``/``pmap`` axis (or axes).

  .. math:: a \leftarrow \max_{d \in \text{devices}} a_d

  Every device must quantize with the same scale, and the scale must cover the
  largest value any device saw: max, not sum or mean (a mean would saturate the
  devices with the largest values). Not needed under sharded ``jit``, where
  amaxes are already global.

  Args:
    amax: a pytree of observations (e.g. of :class:`Fp8DotAmax`).
    axis_name: the mapped axis name, or a tuple of them.

  Returns:
    The same pytree, every leaf max-reduced over ``axis_name``.
  """
  return jax.tree.map(lambda a: lax.pmax(a, axis_name), amax)


def combine_amax(*amaxes: Any) -> Any:
  r"""Elementwise max of the observations of several gradient-accumulation microsteps.

  .. math:: a = \max_i a^{(i)}

  NaN or inf in any of them (an overflowed microstep) wins, so :func:`update`
  drops that tensor's observation for the accumulated step.

  Args:
    *amaxes: one pytree of observations per microstep, all of one structure.

  Returns:
    The pytree of elementwise maxima.

  >>> combine_amax(Fp8DotAmax(1.0, 5.0, 2.0), Fp8DotAmax(3.0, 4.0, jnp.nan)).output_grad
  Array(nan, dtype=float32, weak_type=True)
  """
  if not amaxes:
    raise TypeError("combine_amax needs at least one amax tree.")
  return jax.tree.map(lambda *a: functools.reduce(jnp.maximum, a), *amaxes)


def _update_dot(dot_state: Any, dot_amax: Any, config: Fp8Config) -> Fp8DotState:
  if not isinstance(dot_state, Fp8DotState):
    raise TypeError(
      f"Expected the state's leaves to be Fp8DotState nodes, found {type(dot_state).__name__}."
    )
  if not isinstance(dot_amax, Fp8DotAmax):
    raise TypeError(
      "amax must mirror the state with an Fp8DotAmax for each Fp8DotState (see zeros_amax), "
      f"found {type(dot_amax).__name__}."
    )
  kw: dict[str, Any] = {"margin": config.margin, "amax_compute_algo": config.amax_compute_algo}
  dtypes_ = (config.fwd_dtype, config.fwd_dtype, config.bwd_dtype)
  return Fp8DotState(
    *(
      update_scale(tensor, observed, dtype, **kw)
      for tensor, observed, dtype in zip(dot_state, dot_amax, dtypes_, strict=True)
    )
  )


def update(state: Any, amax: Any, config: Fp8Config | None = None, *, axis_name: Any = None) -> Any:
  r"""Folds one step's observations into a pytree of :class:`Fp8DotState`.

  Each tensor's state goes through :func:`update_scale`: inputs and kernels
  with ``config.fwd_dtype``, output gradients with ``config.bwd_dtype``.

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
    The new state, with the same structure.

  >>> state = init_dot_state(Fp8Config(amax_history_length=2))
  >>> observed = Fp8DotAmax(jnp.float32(896.0), jnp.float32(0.0), jnp.float32(3584.0))
  >>> [float(t.scale) for t in update(state, observed)]  # a zero amax keeps the scale
  [2.0, 0.0, 0.0625]
  """
  config = as_config(config)
  if axis_name is not None:
    amax = reduce_amax(amax, axis_name)
  try:
    return jax.tree.map(lambda s, a: _update_dot(s, a, config), state, amax, is_leaf=_is_dot_state)
  except ValueError as e:
    raise ValueError(
      f"The amax tree does not match the fp8 state tree; build it with zeros_amax(state). {e}"
    ) from e
