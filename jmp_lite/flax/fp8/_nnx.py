"""fp8 matmuls for NNX layers: ops installed into their matmul slots (private).

An NNX layer calls its ``dot_general``/``einsum_op`` with fixed arguments, so
an op reads what the call does not carry from its own variables: its fp8 state
(:class:`Fp8State`), its probes (:class:`Fp8Amax`) and the loss scale the
gradients carry (:class:`Fp8LossScale`), which :func:`nnx_value_and_grad` sets
for the differentiation it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_lite import fp8
from jmp_lite._loss_scale import (
  LossScale,
  NoOpLossScale,
  ScaledGrads,
  StaticLossScale,
  is_loss_scale,
)
from jmp_lite.flax.fp8._common import config_of_spec
from jmp_lite.flax.fp8._placement import check_patterns, record, warn_if_no_fp8
from jmp_lite.fp8._einsum import einsum_dot_shapes
from jmp_lite.fp8._matmul import loss_scale_value
from jmp_lite.fp8._placement import Fp8Placement, as_placement, matmul_dims, positions


class Fp8State(nnx.Variable):
  """NNX variable type of fp8 scales and amax histories (not trained by optimizers)."""


class Fp8Amax(nnx.Variable):
  """NNX variable type of the amax probes: zeros whose gradient is the observations."""


class Fp8LossScale(nnx.Variable):
  """NNX variable type of the loss scale an op's gradients carry (a float32 scalar).

  1 outside :func:`nnx_value_and_grad`, which sets it to its ``loss_scale``
  for the differentiation it runs; only ops that keep state have one.
  """


class NnxFp8DotGeneral(nnx.Module):
  """An fp8 matmul with its own state, for the ``dot_general`` slot of NNX layers.

  Variables (named like ``flax.linen.fp8_ops``): ``{input,kernel,output_grad}_scale``
  and ``..._amax_history`` (:class:`Fp8State`), ``..._amax`` (:class:`Fp8Amax`),
  and ``loss_scale`` (:class:`Fp8LossScale`).

  A recipe that keeps no state (:class:`~jmp_lite.fp8.CurrentScaling`) gives
  an op without variables, and so does an op ``kept`` in the compute dtype.

  Args:
    config: the fp8 recipe (``CurrentScaling()`` by default).
    placement: the :class:`~jmp_lite.fp8.Fp8Placement` whose shape rule
      decides each call (``nnx_fp8`` passes it; ``None``: every call in fp8).
    path: the layer's path, for :func:`placement_report`.
    kept: why the layer stays in the compute dtype whatever its shape, or
      ``None`` (then the op runs in fp8).
  """

  def __init__(
    self,
    config: Any = None,
    *,
    placement: Fp8Placement | None = None,
    path: str = "",
    kept: str | None = None,
  ):
    self.config = fp8.as_recipe(config)
    self.placement = placement
    self.path = path
    self.kept = kept
    state = self.config.init_state() if kept is None else None
    self.stateful = state is not None
    for name, tensor in zip(fp8.Fp8DotState._fields, state or (), strict=False):
      setattr(self, f"{name}_scale", Fp8State(tensor.scale))
      setattr(self, f"{name}_amax_history", Fp8State(tensor.amax_history))
      setattr(self, f"{name}_amax", Fp8Amax(jnp.zeros((), jnp.float32)))
    if self.stateful:
      self.loss_scale = Fp8LossScale(jnp.ones((), jnp.float32))

  @property
  def dot_state(self) -> fp8.Fp8DotState | None:
    """The current :class:`~jmp_lite.fp8.Fp8DotState` (``None`` without state)."""
    if not self.stateful:
      return None
    return fp8.Fp8DotState(
      *(
        fp8.Fp8ScaleState(
          getattr(self, f"{name}_scale").get_value(),
          getattr(self, f"{name}_amax_history").get_value(),
        )
        for name in fp8.Fp8DotState._fields
      )
    )

  @property
  def amax(self) -> fp8.Fp8DotAmax | None:
    """The probe values (zeros, or observations between ``nnx.update`` and ``commit``)."""
    if not self.stateful:
      return None
    return fp8.Fp8DotAmax(
      *(getattr(self, f"{name}_amax").get_value() for name in fp8.Fp8DotAmax._fields)
    )

  def commit(self, *, axis_name: Any = None) -> None:
    """Folds the observations held in the probes into the state; zeroes the probes.

    Args:
      axis_name: under ``shard_map``/``pmap``, max-reduce the observations over
        this axis first (see :func:`jmp_lite.fp8.update`).
    """
    if not self.stateful:
      return
    new = fp8.update(self.dot_state, self.amax, self.config, axis_name=axis_name)
    for name, tensor in zip(fp8.Fp8DotState._fields, new, strict=True):
      getattr(self, f"{name}_scale").set_value(tensor.scale)
      getattr(self, f"{name}_amax_history").set_value(tensor.amax_history)
      probe = getattr(self, f"{name}_amax")
      probe.set_value(jnp.zeros_like(probe.get_value()))

  def _run(self, op: Callable, plain: Callable, lhs: Any, operands: tuple, options: dict):
    """``op`` (fp8) or ``plain`` (the layer's own matmul), as the placement decides."""
    shape = matmul_dims(*self._shapes(*operands))
    reason = self.kept
    if reason is None and self.placement is not None:
      reason = self.placement.shape_reason(*shape)
    if self.placement is not None:
      record(self.path, reason, shape)
    if reason is not None:
      return plain(*operands, **options)
    loss_scale = self.loss_scale.get_value() if self.stateful else None
    return op(
      *operands, self.dot_state, self.amax, config=self.config, loss_scale=loss_scale, **options
    )

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, **options):
    """:func:`jmp_lite.fp8.dot_general` with this op's state and probe.

    Args:
      lhs: the input.
      rhs: the kernel.
      dimension_numbers: as in :func:`jax.lax.dot_general`.
      precision: accepted and ignored (see :func:`jmp_lite.fp8.dot_general`).
      **options: ``preferred_element_type``, ``out_sharding``.

    Returns:
      The product.
    """
    operands = (lhs, rhs, dimension_numbers)
    options = {"precision": precision, **options}
    return self._run(fp8.dot_general, jax.lax.dot_general, lhs, operands, options)

  @staticmethod
  def _shapes(lhs, rhs, dimension_numbers) -> tuple:
    return jnp.shape(lhs), jnp.shape(rhs), dimension_numbers


class NnxFp8Einsum(NnxFp8DotGeneral):
  """An fp8 einsum for the ``einsum_op`` slot of ``nnx.Einsum``.

  Takes :class:`NnxFp8DotGeneral`'s arguments (``config``, ``placement``, ``path``, ``kept``).
  """

  def __call__(self, subscripts, lhs, rhs, precision=None, **options):  # type: ignore[override]
    """:func:`jmp_lite.fp8.einsum` with this op's state and probe.

    Args:
      subscripts: the two-operand einsum equation.
      lhs: the input.
      rhs: the kernel.
      precision: accepted and ignored (see :func:`jmp_lite.fp8.dot_general`).
      **options: ``preferred_element_type``, ``out_sharding``.

    Returns:
      The einsum.
    """
    options = {"precision": precision, **options}
    return self._run(fp8.einsum, jnp.einsum, lhs, (subscripts, lhs, rhs), options)

  @staticmethod
  def _shapes(subscripts, lhs, rhs) -> tuple:  # type: ignore[override]
    return einsum_dot_shapes(subscripts, lhs, rhs)


_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
_SLOT = {False: "dot_general", True: "einsum_op"}


def _slot(layer: Any) -> str:
  """``"ours"``, ``"free"`` (the default matmul) or ``"user"`` (the user set their own)."""
  if isinstance(layer, nnx.Einsum):
    if isinstance(layer.einsum_op, NnxFp8Einsum):
      return "ours"
    return "free" if layer.einsum_op is jnp.einsum else "user"
  if isinstance(layer.dot_general, NnxFp8DotGeneral):
    return "ours"
  default = layer.dot_general is None or layer.dot_general is jax.lax.dot_general
  return "free" if default and getattr(layer, "dot_general_cls", None) is None else "user"


def _install(layer: Any, config: Any, **options: Any) -> None:
  """Puts an fp8 op into one layer's matmul slot."""
  if isinstance(layer, nnx.Einsum):
    layer.einsum_op = nnx.data(NnxFp8Einsum(config, **options))
  else:
    layer.dot_general = nnx.data(NnxFp8DotGeneral(config, **options))


def _free_layers(model: nnx.Module) -> dict[str, tuple[Any, tuple[type, ...]]]:
  """``{path: (layer, classes)}`` of the layers with their default matmul, in graph order.

  ``classes`` are the layer's and those of the modules holding it.
  """
  nodes = {tuple(path): node for path, node in nnx.iter_graph(model)}
  layers = {}
  for path, node in nodes.items():
    if isinstance(node, _LAYERS) and _slot(node) == "free":
      enclosing = (nodes[path[:n]] for n in range(len(path) + 1))
      classes = tuple(type(m) for m in enclosing if isinstance(m, nnx.Module))
      layers["/".join(str(p) for p in path)] = (node, classes)
  return layers


def _recorder(einsum: bool, path: str, order: list) -> Callable[..., Any]:
  """A layer's own matmul that appends ``(path, input)`` to ``order`` when called."""
  if einsum:

    def einsum_op(subscripts, lhs, rhs, *args, **kwargs):
      order.append((path, lhs))
      return jnp.einsum(subscripts, lhs, rhs, *args, **kwargs)

    return einsum_op

  def dot_general(lhs, rhs, *args, **kwargs):
    order.append((path, lhs))
    return jax.lax.dot_general(lhs, rhs, *args, **kwargs)

  return dot_general


def _discover(model: nnx.Module, layers: dict, example_call: Any) -> dict:
  """The first and last layers ``example_call(model)`` calls (one abstract run, plain matmuls)."""
  slots = {path: _SLOT[type(layer) is nnx.Einsum] for path, (layer, _) in layers.items()}
  saved = {path: getattr(layer, slots[path]) for path, (layer, _) in layers.items()}
  order: list = []
  for path, (layer, _) in layers.items():
    setattr(layer, slots[path], _recorder(type(layer) is nnx.Einsum, path, order))
  try:
    nnx.eval_shape(example_call, model)
  finally:  # the layers as they were, whatever example_call did
    for path, (layer, _) in layers.items():
      setattr(layer, slots[path], saved[path])
  if not order:
    raise ValueError(
      f"example_call called no matmul layer of {type(model).__name__}: it must call the model "
      "(e.g. example_call=lambda model: model(x)) to find its first and last layers."
    )
  return positions(order)


def nnx_fp8(
  model: nnx.Module,
  fp8_spec: Any = None,
  *,
  placement: Any = None,
  example_call: Callable[[Any], Any] | None = None,
) -> nnx.Module:
  """Makes the matmuls of the ``nnx.Linear``/``LinearGeneral``/``Einsum`` layers of ``model`` fp8.

  Mutates ``model`` in place: each layer's ``dot_general`` (``einsum_op`` for
  Einsum) becomes an :class:`NnxFp8DotGeneral` (:class:`NnxFp8Einsum`)
  holding the layer's fp8 state. Layers with a user-supplied
  ``dot_general``/``einsum_op`` are left alone; calling it twice changes
  nothing. The layers ``placement`` keeps in the compute dtype get an op
  without state that computes the layer's own matmul (and reports it to
  :func:`placement_report`).

  Args:
    model: the NNX model.
    fp8_spec: the recipe, in any form :func:`~jmp_lite.flax.fp8.linen_interceptor`
      takes (default :class:`~jmp_lite.fp8.CurrentScaling`). A policy without
      fp8 leaves the model as it is.
    placement: which layers run in fp8, as in
      :func:`~jmp_lite.flax.fp8.linen_interceptor`; whether a matmul is too
      small to pay is decided at each call from its shape.
    example_call: ``example_call(model)`` calls the model as training does
      (``lambda model: model(x)``); run once abstractly to find the first and
      last matmul layers. Required while ``placement.keep_first_last``.

  Returns:
    ``model``.

  Raises:
    ValueError: if the model has no layer that can run in fp8, a pattern of
      ``placement`` matches none, or the first and last layers are to be kept
      without an ``example_call``.
  """
  config = config_of_spec(fp8_spec)
  placement = as_placement(placement)
  if example_call is not None and not callable(example_call):
    raise TypeError(f"example_call must be a function of the model, got {example_call!r}.")
  if config is None:
    return model
  name = type(model).__name__
  layers = _free_layers(model)
  if not layers:
    if any(_slot(node) == "ours" for _, node in nnx.iter_graph(model) if isinstance(node, _LAYERS)):
      return model
    raise ValueError(
      f"{name} has no nnx.Linear, nnx.LinearGeneral or nnx.Einsum layer with the default "
      "dot_general/einsum_op to run in fp8."
    )
  check_patterns(placement, {path: classes for path, (_, classes) in layers.items()}, name)
  found = {}
  if placement.keep_first_last:
    if example_call is None:
      raise ValueError(
        f"nnx_fp8 keeps the first and last matmul layers of {name} in the compute dtype "
        "(Fp8Placement(keep_first_last=True), the default) and finds them by calling the model "
        "once: pass example_call=lambda model: model(x), or placement=fp8.Fp8Placement("
        "keep_first_last=False) to run them in fp8 too."
      )
    found = _discover(model, layers, example_call)
  reasons = {}
  for path, (layer, classes) in layers.items():
    reasons[path] = placement.reason(path, classes, found.get(path))
    _install(layer, config, placement=placement, path=path, kept=reasons[path])
  warn_if_no_fp8(reasons, name)
  return model


def nnx_update(model: nnx.Module, amax: nnx.State | None = None, *, axis_name: Any = None) -> None:
  """Folds fp8 observations into every fp8 op of ``model``, in place.

  Args:
    model: a model prepared with :func:`nnx_fp8`.
    amax: the gradient with respect to the :class:`Fp8Amax` variables (an
      ``nnx.State``); ``None`` uses the values already in the probes.
    axis_name: under ``shard_map``/``pmap``, max-reduce over this axis first.
  """
  if amax is not None:
    nnx.update(model, amax)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, NnxFp8DotGeneral):
      node.commit(axis_name=axis_name)


def nnx_calibrate(
  fun: Callable[..., Any], *, has_aux: bool = False, axis_name: Any = None
) -> Callable[..., Any]:
  r""":func:`jmp_lite.fp8.calibrate` for an NNX model prepared with :func:`nnx_fp8`.

  The returned function runs ``fun(model, *args, **kwargs)`` and its gradient
  with respect to the fp8 probes once under :func:`jmp_lite.fp8.current_scaling`,
  and folds the observations into the model's fp8 state in place (parameters
  untouched): each scale becomes

  .. math:: s = \frac{\max|x| \cdot 2^{\text{margin}}}{\text{fp8\_max}}.

  Call it on a fresh model with the first batch, before the first training
  step; the step itself is unchanged.

  Args:
    fun: the training loss, ``fun(model, *args, **kwargs)``, returning a scalar
      (or ``(loss, aux)`` with ``has_aux``).
    has_aux: as in ``nnx.value_and_grad``.
    axis_name: under ``shard_map``/``pmap``, max-reduce the observations over
      this axis first.

  Returns:
    A function of ``(model, *args, **kwargs)`` returning what ``fun`` returned.
  """
  if not callable(fun):
    raise TypeError(f"fun must be a function of the model, got {fun!r}.")
  grad_fn = nnx.value_and_grad(fun, argnums=nnx.DiffState(0, Fp8Amax), has_aux=has_aux)

  def calibrate(model, *args, **kwargs):
    with fp8.current_scaling() as scope:
      value, amax = grad_fn(model, *args, **kwargs)
    if scope.probed_ops == 0:
      raise ValueError(
        f"fun traced no fp8 matmul of {type(model).__name__}, so nothing was calibrated: "
        "prepare the model with nnx_fp8 first, and trace its calls inside fun (not an "
        "nnx.jit/jax.jit function compiled before)."
      )
    nnx_update(model, amax, axis_name=axis_name)
    return value

  return calibrate


def nnx_value_and_grad(
  fun: Callable[..., Any],
  *,
  wrt: Any = nnx.Param,
  has_aux: bool = False,
  loss_scale: Any = None,
  axis_name: Any = None,
) -> Callable[..., tuple[Any, nnx.State]]:
  """``nnx.value_and_grad`` of ``fun(model, ...)`` that also updates the fp8 state.

  The returned function differentiates ``fun`` with respect to the ``wrt``
  variables of its first argument (the model) and the fp8 probes, folds the
  observations into the model's fp8 state (in place, as NNX does) and returns
  ``(value, grads)`` with the ``wrt`` gradients only.

  With a ``loss_scale`` (a jmp_lite loss scale, or an array), it
  differentiates ``loss_scale * fun`` and returns the unscaled value and the
  *scaled* gradients, ready for :func:`jmp_lite.loss_scaling`'s ``update``;
  each fp8 op that keeps state holds the loss scale in its
  :class:`Fp8LossScale` variable while ``fun`` is differentiated (1 again
  after), so its output-gradient scales compose with it.

  Args:
    fun: returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
    wrt: the NNX filter of variables to differentiate (default ``nnx.Param``).
    has_aux: as in ``nnx.value_and_grad``.
    loss_scale: the loss scale, or ``None``.
    axis_name: under ``shard_map``/``pmap``, the axis to max-reduce the fp8
      observations over (reduce the gradients yourself, as usual).

  Returns:
    A function of ``(model, *args, **kwargs)`` returning ``(value, grads)``,
    as ``nnx.value_and_grad`` does.
  """
  if loss_scale is None:
    scaling: LossScale = NoOpLossScale()
  elif is_loss_scale(loss_scale):
    scaling = loss_scale
  else:
    scaling = StaticLossScale(loss_scale)
  grad_fn = scaling.value_and_grad(
    fun,
    has_aux=has_aux,
    argnums=nnx.DiffState(0, nnx.Any(wrt, Fp8Amax)),
    value_and_grad=nnx.value_and_grad,
  )

  def value_and_grad(model, *args, **kwargs):
    scales = [
      node.loss_scale
      for _, node in nnx.iter_graph(model)
      if isinstance(node, NnxFp8DotGeneral) and node.stateful
    ]
    if scales:  # only delayed scaling reads it: current scaling takes any loss scale
      scale = loss_scale_value(loss_scale)
      for variable in scales:
        variable.set_value(scale)
    try:
      value, grads = grad_fn(model, *args, **kwargs)
    finally:
      for variable in scales:
        variable.set_value(jnp.ones((), jnp.float32))
    scaled = ScaledGrads.of(grads)
    amax, param_grads = nnx.split_state(scaled.grads, Fp8Amax, ...)
    nnx_update(model, amax, axis_name=axis_name)
    return value, scaled._replace(grads=param_grads).packed()

  return value_and_grad
