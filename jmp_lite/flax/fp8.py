"""fp8 matmuls for Flax layers, linen and NNX, applied from outside the model.

The layers whose matmuls become fp8 (:mod:`jmp_lite.fp8`):

========================  ==========================  ==================================
layer                     linen                       NNX
========================  ==========================  ==================================
dense                     ``nn.Dense``                ``nnx.Linear``
general dense             ``nn.DenseGeneral``         ``nnx.LinearGeneral``
einsum                    ``nn.Einsum``               ``nnx.Einsum``
========================  ==========================  ==================================

**linen**: inside ``with linen_fp8(config):`` every such layer computes its
matmul with :func:`jmp_lite.fp8.dot_general` (an ``nn.intercept_methods``
interceptor; the model code is unchanged). Each layer keeps an
:class:`~jmp_lite.fp8.Fp8DotState` in the ``"fp8_state"`` collection, created
by ``init``, and reads an optional :class:`~jmp_lite.fp8.Fp8DotAmax` probe from
the ``"fp8_amax"`` collection::

  with linen_fp8(config):
    variables = model.init(key, x)       # {"params": ..., "fp8_state": ...}

  def loss_fn(params, amax):
    with linen_fp8(config, loss_scale=loss_scale):
      y = model.apply({"params": params, "fp8_state": fp8_state, "fp8_amax": amax}, x)
    return loss(y)

  _, (grads, amax) = jl.scaled_value_and_grad(loss_fn, loss_scale, argnums=(0, 1))(
      params, fp8.zeros_amax(fp8_state))
  fp8_state = fp8.update(fp8_state, amax, config)

Layers whose user already set ``dot_general``/``dot_general_cls`` keep it. The
explicit alternative to interception is ``nn.Dense(..., dot_general_cls=
functools.partial(LinenFp8DotGeneral, config=config))``.

**NNX**: :func:`nnx_fp8` installs an fp8 op into each layer's ``dot_general``
/ ``einsum_op`` slot; the op holds the state as :class:`Fp8State` variables and
the probes as :class:`Fp8Amax` variables. :func:`nnx_value_and_grad`
differentiates with respect to both the parameters and the probes and folds
the observations into the state in place.

The loss scale the gradients carry reaches the fp8 ops through
:func:`loss_scale_scope` (``linen_fp8`` and ``nnx_value_and_grad`` take a
``loss_scale`` argument that sets it).

Before the first training step, set the scales from a first batch (the
initial scales of 1 flush small gradients and saturate large activations; see
:func:`jmp_lite.fp8.calibrate`): linen's ``"fp8_state"`` is a pytree of
:class:`~jmp_lite.fp8.Fp8DotState`, so ``fp8.calibrate`` applies to it as is;
for NNX, ``nnx_calibrate(loss_fn)(model, *batch)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jmp_lite import _policy as policy_lib
from jmp_lite import fp8
from jmp_lite._loss_scale import LossScale, NoOpLossScale, StaticLossScale

STATE_COLLECTION = "fp8_state"
AMAX_COLLECTION = "fp8_amax"
VARIABLE_NAME = "fp8_dot"

# -----------------------------------------------------------------------------
# Loss scale


class _LossScaleStack(threading.local):
  def __init__(self):
    self.values: list[Any] = []


_loss_scales = _LossScaleStack()


@contextlib.contextmanager
def loss_scale_scope(loss_scale: Any) -> Iterator[None]:
  """Tells the fp8 ops traced inside which loss scale the gradients carry.

  ``loss_scale`` is a number, a scalar array (a tracer inside ``jit`` is fine:
  it is read while tracing), a jmp_lite loss scale, or ``None`` (1).
  """
  _loss_scales.values.append(loss_scale)
  try:
    yield
  finally:
    _loss_scales.values.pop()


def _current_loss_scale() -> Any:
  return _loss_scales.values[-1] if _loss_scales.values else None


def _as_config(spec: Any) -> fp8.Fp8Config | None:
  """An Fp8Config (None = no fp8) from a config, Fp8Policy, Policy or policy string."""
  if spec is None:
    return fp8.Fp8Config()
  if isinstance(spec, fp8.Fp8Config):
    return spec
  if isinstance(spec, (str, policy_lib.Policy, fp8.Fp8Policy)):
    return fp8.get_fp8_policy(spec).config
  raise TypeError(
    "Expected an Fp8Config, an Fp8Policy, a Policy or a policy string such as "
    f"'p=f32,c=bf16,o=f32,fp8=hybrid'; got {spec!r} of type {type(spec).__name__}."
  )


# -----------------------------------------------------------------------------
# linen


def _linen_variables(module: nn.Module, config: fp8.Fp8Config):
  """The layer's fp8 state (created at init) and its amax probe, if given."""
  if module.has_variable(STATE_COLLECTION, VARIABLE_NAME):
    state: Any = module.get_variable(STATE_COLLECTION, VARIABLE_NAME)
  elif module.is_mutable_collection(STATE_COLLECTION):
    state = module.variable(STATE_COLLECTION, VARIABLE_NAME, fp8.init_dot_state, config).value
  else:
    raise ValueError(
      f"Layer {'/'.join(module.path) or type(module).__name__} runs in fp8 but has no "
      f"'{STATE_COLLECTION}' variables: pass the '{STATE_COLLECTION}' collection that init "
      f"returned to apply (inside linen_fp8 at init too), or make it mutable."
    )
  if module.has_variable(AMAX_COLLECTION, VARIABLE_NAME):
    return state, module.get_variable(AMAX_COLLECTION, VARIABLE_NAME)
  return state, None


def _bound_dot_general(state, amax, config) -> Callable[..., jax.Array]:
  """A ``lax.dot_general``-compatible function running this layer's fp8 matmul."""

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    # Read at call time: the loss scale is a tracer of the step being traced.
    return fp8.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      state,
      amax,
      config=config,
      loss_scale=_current_loss_scale(),
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=kw.get("out_sharding"),
    )

  return dot_general


class LinenFp8DotGeneral(nn.Module):
  """An fp8 matmul for linen's ``dot_general_cls`` slot (explicit injection).

  ``nn.Dense(16, dot_general_cls=functools.partial(LinenFp8DotGeneral,
  config=config))`` keeps its state and probe under the Dense's child
  ``LinenFp8DotGeneral_0`` in the same collections as :func:`linen_fp8`.
  """

  config: fp8.Fp8Config = fp8.Fp8Config()

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    state, amax = _linen_variables(self, self.config)
    return _bound_dot_general(state, amax, self.config)(
      lhs, rhs, dimension_numbers, precision, preferred_element_type
    )


def _linen_einsum(module: nn.Einsum, config: fp8.Fp8Config, inputs, einsum_str=None):
  """``nn.Einsum.__call__`` with the contraction in fp8.

  linen's Einsum calls ``jnp.einsum`` directly (no injection point), so this
  repeats its few lines: same parameter names, shapes, initializers and dtype
  promotion, so parameters are interchangeable with the plain layer's.
  """
  einsum_str = nn.module.merge_param("einsum_str", module.einsum_str, einsum_str)
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str:
    raise ValueError('`einsum_str` equation must be explicit and include "->".')
  if einsum_str.count(",") != 1:
    raise ValueError(
      "`einsum_str` equation must have exactly two operands and therefore exactly one comma "
      f"character, instead of {einsum_str.count(',')}"
    )
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  bias = None
  if module.use_bias:
    _, rhs, out = fp8._einsum_subscripts(einsum_str, jnp.ndim(inputs), len(module.shape))
    bias_shape = tuple(module.shape[rhs.index(c)] for c in out if c in rhs)
    broadcast_shape = tuple(module.shape[rhs.index(c)] if c in rhs else 1 for c in out)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  promote = getattr(module, "promote_dtype", nn.dtypes.promote_dtype)
  inputs, kernel, bias = promote(inputs, kernel, bias, dtype=module.dtype)
  state, amax = _linen_variables(module, config)
  y = fp8.einsum(
    einsum_str,
    inputs,
    kernel,
    state,
    amax,
    config=config,
    loss_scale=_current_loss_scale(),
    preferred_element_type=getattr(module, "preferred_element_type", None),
  )
  if bias is not None:
    y = y + jnp.reshape(bias, broadcast_shape)
  return y


class _LinenFp8Einsum(nn.Einsum):
  """``nn.Einsum`` computing in fp8; what the interceptor calls in place of an Einsum."""

  fp8_config: fp8.Fp8Config = fp8.Fp8Config()

  @nn.compact
  def __call__(self, inputs, einsum_str=None):
    return _linen_einsum(self, self.fp8_config, inputs, einsum_str)


def _bound_copy(module: nn.Module, cls: type, **updates: Any) -> nn.Module:
  """A module of ``cls`` with ``module``'s fields, bound to the same scope.

  Sharing the scope shares the variables. Calling the copy goes through the
  interceptor stack again, so interceptors registered inside this one (e.g. a
  precision policy's input casts) still see the layer's call.
  """
  fields = {
    f.name: getattr(module, f.name)
    for f in dataclasses.fields(module)
    if f.init and f.name not in ("parent", "name")
  }
  return cls(**{**fields, **updates}, parent=module.scope)


def linen_interceptor(fp8_spec: Any = None) -> Callable[..., Any]:
  """The ``nn.intercept_methods`` interceptor behind :func:`linen_fp8`.

  For composing with other interceptors (e.g. a precision-policy one). It
  reads the loss scale from :func:`loss_scale_scope` at call time.

  Args:
    fp8_spec: an :class:`~jmp_lite.fp8.Fp8Config` (default ``Fp8Config()``),
      an :class:`~jmp_lite.fp8.Fp8Policy`, or a policy string such as
      ``"p=f32,c=bf16,o=f32,fp8=hybrid"``. A policy without fp8 gives an
      interceptor that changes nothing.
  """
  config = _as_config(fp8_spec)

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if config is None or context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
      if module.dot_general is not None or module.dot_general_cls is not None:
        return next_fun(*args, **kwargs)  # the user's own matmul (or ours, below) wins
      state, amax = _linen_variables(module, config)
      # Flax's own __call__, with the fp8 matmul injected.
      dot_general = _bound_dot_general(state, amax, config)
      return _bound_copy(module, type(module), dot_general=dot_general)(*args, **kwargs)
    if type(module) is nn.Einsum:  # a subclass may compute something else
      return _bound_copy(module, _LinenFp8Einsum, fp8_config=config)(*args, **kwargs)
    return next_fun(*args, **kwargs)

  return interceptor


@contextlib.contextmanager
def linen_fp8(fp8_spec: Any = None, *, loss_scale: Any = None) -> Iterator[None]:
  """Runs the matmuls of linen Dense/DenseGeneral/Einsum layers in fp8.

  Use it around ``init`` (to create the ``"fp8_state"`` collection) and
  around ``apply``. Within a traced train step, pass the loss scale the
  gradients carry (``jl.get_loss_scale(opt_state)``) so the output-gradient
  scales compose with it.

  Args:
    fp8_spec: see :func:`linen_interceptor`.
    loss_scale: see :func:`loss_scale_scope`.
  """
  with nn.intercept_methods(linen_interceptor(fp8_spec)), loss_scale_scope(loss_scale):
    yield


# -----------------------------------------------------------------------------
# NNX


class Fp8State(nnx.Variable):
  """NNX variable type of fp8 scales and amax histories (not trained by optimizers)."""


class Fp8Amax(nnx.Variable):
  """NNX variable type of the amax probes: zeros whose gradient is the observations."""


class NnxFp8DotGeneral(nnx.Module):
  """An fp8 matmul with its own state, for the ``dot_general`` slot of NNX layers.

  Variables (named like ``flax.linen.fp8_ops``): ``{input,kernel,output_grad}_scale``
  and ``..._amax_history`` (:class:`Fp8State`), ``..._amax`` (:class:`Fp8Amax`).
  """

  def __init__(self, config: fp8.Fp8Config | None = None):
    self.config = fp8._as_config(config)
    state = fp8.init_dot_state(self.config)
    for name, tensor in zip(fp8.Fp8DotState._fields, state, strict=True):
      setattr(self, f"{name}_scale", Fp8State(tensor.scale))
      setattr(self, f"{name}_amax_history", Fp8State(tensor.amax_history))
      setattr(self, f"{name}_amax", Fp8Amax(jnp.zeros((), jnp.float32)))

  @property
  def dot_state(self) -> fp8.Fp8DotState:
    """The current :class:`~jmp_lite.fp8.Fp8DotState`."""
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
  def amax(self) -> fp8.Fp8DotAmax:
    """The probe values (zeros, or observations between ``nnx.update`` and ``commit``)."""
    return fp8.Fp8DotAmax(
      *(getattr(self, f"{name}_amax").get_value() for name in fp8.Fp8DotAmax._fields)
    )

  def commit(self, *, axis_name: Any = None) -> None:
    """Folds the observations held in the probes into the state; zeroes the probes."""
    new = fp8.update(self.dot_state, self.amax, self.config, axis_name=axis_name)
    for name, tensor in zip(fp8.Fp8DotState._fields, new, strict=True):
      getattr(self, f"{name}_scale").set_value(tensor.scale)
      getattr(self, f"{name}_amax_history").set_value(tensor.amax_history)
      probe = getattr(self, f"{name}_amax")
      probe.set_value(jnp.zeros_like(probe.get_value()))

  def __call__(
    self,
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
  ):
    return fp8.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      self.dot_state,
      self.amax,
      config=self.config,
      loss_scale=_current_loss_scale(),
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )


class NnxFp8Einsum(NnxFp8DotGeneral):
  """An fp8 einsum for the ``einsum_op`` slot of ``nnx.Einsum``."""

  def __call__(  # type: ignore[override]
    self,
    subscripts,
    lhs,
    rhs,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
  ):
    return fp8.einsum(
      subscripts,
      lhs,
      rhs,
      self.dot_state,
      self.amax,
      config=self.config,
      loss_scale=_current_loss_scale(),
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )


def _install(layer: Any, config: fp8.Fp8Config) -> bool:
  """Puts an fp8 op into one layer's matmul slot; False if the user set their own."""
  if isinstance(layer, nnx.Einsum):
    if isinstance(layer.einsum_op, NnxFp8Einsum):
      return True
    if layer.einsum_op is not jnp.einsum:
      return False
    layer.einsum_op = nnx.data(NnxFp8Einsum(config))
    return True
  if isinstance(layer.dot_general, NnxFp8DotGeneral):
    return True
  default = layer.dot_general is None or layer.dot_general is jax.lax.dot_general
  if not default or getattr(layer, "dot_general_cls", None) is not None:
    return False
  layer.dot_general = nnx.data(NnxFp8DotGeneral(config))
  return True


def nnx_fp8(model: nnx.Module, fp8_spec: Any = None) -> nnx.Module:
  """Makes the matmuls of every ``nnx.Linear``/``LinearGeneral``/``Einsum`` in ``model`` fp8.

  Mutates ``model`` in place (and returns it): each layer's ``dot_general``
  (``einsum_op`` for Einsum) becomes an :class:`NnxFp8DotGeneral`
  (:class:`NnxFp8Einsum`) holding the layer's fp8 state. Layers with a
  user-supplied ``dot_general``/``einsum_op`` are left alone; calling it twice
  changes nothing.

  Args:
    model: the NNX model.
    fp8_spec: see :func:`linen_interceptor`.

  Raises:
    ValueError: if the model has no layer that can run in fp8.
  """
  config = _as_config(fp8_spec)
  if config is None:
    return model
  layers = [
    node
    for _, node in nnx.iter_graph(model)
    if isinstance(node, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum))
  ]
  installed = [_install(layer, config) for layer in layers]
  if not any(installed):
    raise ValueError(
      f"{type(model).__name__} has no nnx.Linear, nnx.LinearGeneral or nnx.Einsum layer with "
      "the default dot_general/einsum_op to run in fp8."
    )
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
  """:func:`jmp_lite.fp8.calibrate` for an NNX model prepared with :func:`nnx_fp8`.

  The returned function runs ``fun(model, *args, **kwargs)`` and its gradient
  with respect to the fp8 probes once under :func:`jmp_lite.fp8.current_scaling`,
  and folds the observations into the model's fp8 state in place (parameters
  untouched). Call it on a fresh model with the first batch, before the first
  training step; the step itself is unchanged.

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


def _split_state(state: nnx.State, *filters: Any) -> tuple[nnx.State, ...]:
  if hasattr(nnx, "split_state"):  # flax >= 0.11; State.filter is deprecated there
    return nnx.split_state(state, *filters)
  return state.filter(*filters)


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
  the fp8 ops see the loss scale so their output-gradient scales compose with
  it.

  Args:
    fun: returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
    wrt: the NNX filter of variables to differentiate (default ``nnx.Param``).
    has_aux: as in ``nnx.value_and_grad``.
    loss_scale: the loss scale, or ``None``.
    axis_name: under ``shard_map``/``pmap``, the axis to max-reduce the fp8
      observations over (reduce the gradients yourself, as usual).
  """
  if loss_scale is None:
    scaling: LossScale = NoOpLossScale()
  elif isinstance(loss_scale, LossScale):
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
    with loss_scale_scope(loss_scale):
      value, grads = grad_fn(model, *args, **kwargs)
    amax, param_grads = _split_state(grads, Fp8Amax, ...)
    nnx_update(model, amax, axis_name=axis_name)
    return value, param_grads

  return value_and_grad


__all__ = (
  "AMAX_COLLECTION",
  "STATE_COLLECTION",
  "VARIABLE_NAME",
  "Fp8Amax",
  "Fp8State",
  "LinenFp8DotGeneral",
  "NnxFp8DotGeneral",
  "NnxFp8Einsum",
  "linen_fp8",
  "linen_interceptor",
  "loss_scale_scope",
  "nnx_calibrate",
  "nnx_fp8",
  "nnx_update",
  "nnx_value_and_grad",
)
