"""fp8 matmuls for linen layers, by interception or explicit injection (private).

The loss scale reaches the ops explicitly: the interceptor closes over the one
:func:`linen_fp8` is given, and :class:`LinenFp8DotGeneral` holds it as a field.
One value is ambient, ``_RUN`` (the outermost module call under the
interceptor), because Flax calls an interceptor with its own fixed arguments,
so the nested calls it intercepts can be given nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmp_lite import fp8
from jmp_lite._context import Ambient
from jmp_lite.flax.fp8._common import config_of_spec
from jmp_lite.flax.fp8._placement import check_patterns, record, warn_if_no_fp8
from jmp_lite.fp8._einsum import einsum_dot_shapes, einsum_subscripts
from jmp_lite.fp8._placement import Fp8Placement, as_placement, matmul_dims, positions

STATE_COLLECTION = "fp8_state"
AMAX_COLLECTION = "fp8_amax"
VARIABLE_NAME = "fp8_dot"


def _linen_variables(module: nn.Module, config: Any):
  """The layer's fp8 state (created at init) and its amax probe, if given.

  ``(None, None)`` for a recipe that keeps no state.
  """
  if config.init_state() is None:
    return None, None
  if module.has_variable(STATE_COLLECTION, VARIABLE_NAME):
    state: Any = module.get_variable(STATE_COLLECTION, VARIABLE_NAME)
  elif module.is_mutable_collection(STATE_COLLECTION):
    state = module.variable(STATE_COLLECTION, VARIABLE_NAME, config.init_state).value
  else:
    raise ValueError(
      f"Layer {'/'.join(module.path) or type(module).__name__} runs in fp8 but has no "
      f"'{STATE_COLLECTION}' variables: pass the '{STATE_COLLECTION}' collection that init "
      f"returned to apply (inside linen_fp8 at init too, with the same placement), or make it "
      "mutable."
    )
  if module.has_variable(AMAX_COLLECTION, VARIABLE_NAME):
    return state, module.get_variable(AMAX_COLLECTION, VARIABLE_NAME)
  return state, None


def _bound_dot_general(state, amax, config, loss_scale, decide=None) -> Callable[..., jax.Array]:
  """A ``lax.dot_general``-compatible function running this layer's fp8 matmul.

  ``loss_scale`` is the one the gradients carry; ``decide(m, k, n)`` (the
  placement's shape rule) may keep the matmul in the operands' dtype.
  """

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    if decide is not None and not decide(*matmul_dims(lhs.shape, rhs.shape, dimension_numbers)):
      return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type, **kw
      )
    return fp8.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      state,
      amax,
      config=config,
      loss_scale=loss_scale,
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
  With loss scaling, give it the loss scale as well (build the model inside
  the loss function, where the loss scale is known).

  Attributes:
    config: the fp8 recipe (``CurrentScaling()`` by default).
    loss_scale: the loss scale the gradients carry (a number, a scalar array,
      a tracer inside ``jit``, a jmp_lite loss scale, or ``None``: 1), as in
      :func:`jmp_lite.fp8.dot_general`.
  """

  config: Any = fp8.CurrentScaling()
  loss_scale: Any = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """:func:`jmp_lite.fp8.dot_general` with this layer's state and probe.

    Args:
      lhs: the input.
      rhs: the kernel.
      dimension_numbers: as in :func:`jax.lax.dot_general`.
      precision: accepted and ignored (see :func:`jmp_lite.fp8.dot_general`).
      preferred_element_type: the output dtype.

    Returns:
      The product.
    """
    config = fp8.as_recipe(self.config)
    state, amax = _linen_variables(self, config)
    return _bound_dot_general(state, amax, config, self.loss_scale)(
      lhs, rhs, dimension_numbers, precision, preferred_element_type
    )


def _linen_einsum(module: nn.Einsum, config: Any, loss_scale, inputs, einsum_str=None, decide=None):
  """``nn.Einsum.__call__`` with the contraction in fp8.

  linen's Einsum calls ``jnp.einsum`` directly (no injection point), so this
  repeats its few lines: same parameter names, shapes, initializers and dtype
  promotion, so parameters are interchangeable with the plain layer's.
  """
  einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str)
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
    _, rhs, out = einsum_subscripts(einsum_str, jnp.ndim(inputs), len(module.shape))
    bias_shape = tuple(module.shape[rhs.index(c)] for c in out if c in rhs)
    broadcast_shape = tuple(module.shape[rhs.index(c)] if c in rhs else 1 for c in out)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  promote = getattr(module, "promote_dtype", nn.dtypes.promote_dtype)
  inputs, kernel, bias = promote(inputs, kernel, bias, dtype=module.dtype)
  state, amax = _linen_variables(module, config)
  preferred = getattr(module, "preferred_element_type", None)
  if decide is None or decide(*matmul_dims(*einsum_dot_shapes(einsum_str, inputs, kernel))):
    y = fp8.einsum(
      einsum_str,
      inputs,
      kernel,
      state,
      amax,
      config=config,
      loss_scale=loss_scale,
      preferred_element_type=preferred,
    )
  else:  # as nn.Einsum computes it
    y = jnp.einsum(
      einsum_str, inputs, kernel, precision=module.precision, preferred_element_type=preferred
    )
  if bias is not None:
    y = y + jnp.reshape(bias, broadcast_shape)
  return y


class _LinenFp8Einsum(nn.Einsum):
  """``nn.Einsum`` computing in fp8; what the interceptor calls in place of an Einsum."""

  fp8_config: Any = fp8.CurrentScaling()
  fp8_loss_scale: Any = None
  fp8_decide: Any = None

  @nn.compact
  def __call__(self, inputs, einsum_str=None):
    config, loss_scale = self.fp8_config, self.fp8_loss_scale
    return _linen_einsum(self, config, loss_scale, inputs, einsum_str, self.fp8_decide)


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


class _Run:
  """One outermost module call (an ``init`` or ``apply``) under :func:`linen_interceptor`."""

  def __init__(self, placement: Fp8Placement, layer_positions: dict, discovering: bool):
    self.placement = placement
    self.positions = layer_positions
    self.discovering = discovering
    self.classes: list[type] = []  # the modules being called, outermost first
    self.order: list[tuple[str, Any]] = []  # discovering: (path, input) of each layer call
    self.layers: dict[str, tuple[type, ...]] = {}
    self.reasons: dict[str, str | None] = {}

  @contextlib.contextmanager
  def inside(self, cls: type) -> Iterator[None]:
    self.classes.append(cls)
    try:
      yield
    finally:
      self.classes.pop()

  def decide(self, path: str, reason: str | None, shape: Any = None) -> bool:
    self.reasons[path] = reason
    record(path, reason, shape)
    return reason is None

  def shape_rule(self, path: str) -> Callable[[int, int, int], bool]:
    """The decision of one layer's matmul by its size, recorded."""
    return lambda m, k, n: self.decide(path, self.placement.shape_reason(m, k, n), (m, k, n))


_RUN: Ambient[_Run] = Ambient("jmp_lite.flax.fp8.linen_run")


def _path(module: nn.Module) -> str:
  return "/".join(str(name) for name in module.path)


def _discover(context: Any, args: tuple, kwargs: dict, placement: Fp8Placement) -> dict:
  """The first and last matmul layers of the call about to run, from an abstract run of it.

  The outermost module, unbound, runs once under ``jax.eval_shape`` (``init``
  or ``apply`` as the real call does, with the same variables), the layers
  computing their plain matmuls, recording the order they are called in and
  their inputs (kept alive until :func:`positions` compares them by identity).
  """
  module = context.module
  clone = module.clone(parent=None)
  rngs = {name: jax.random.key(0) for name in ("params", *module.scope.rngs)}
  run = _Run(placement, {}, discovering=True)

  def trace():
    with _RUN.scope(run):
      if module.is_initializing():
        clone.init_with_output(rngs, *args, method=context.method_name, **kwargs)
      else:
        variables = module.variables
        clone.apply(variables, *args, rngs=rngs, method=context.method_name, mutable=True, **kwargs)

  jax.eval_shape(trace)
  prefix = _path(module)
  return positions([(f"{prefix}/{p}" if prefix else p, x) for p, x in run.order])


def _is_layer(module: nn.Module) -> bool:
  """A layer whose matmul the interceptor replaces (not one whose user set their own)."""
  if isinstance(module, (nn.Dense, nn.DenseGeneral)):
    return module.dot_general is None and module.dot_general_cls is None
  return type(module) is nn.Einsum  # a subclass may compute something else


def linen_interceptor(
  fp8_spec: Any = None, placement: Any = None, *, loss_scale: Any = None
) -> Callable[..., Any]:
  """The ``nn.intercept_methods`` interceptor behind :func:`linen_fp8`.

  For composing with other interceptors (e.g. a precision-policy one). Layers
  whose user already set ``dot_general``/``dot_general_cls`` keep it, and so
  do subclasses of ``nn.Einsum`` (they may compute something else).

  Args:
    fp8_spec: an fp8 recipe (default :class:`~jmp_lite.fp8.CurrentScaling`;
      an :class:`~jmp_lite.fp8.Fp8Config` is delayed scaling), an
      :class:`~jmp_lite.fp8.Fp8Policy`, or a policy string such as
      ``"p=f32,c=bf16,o=f32,fp8=current"``. A policy without fp8 gives an
      interceptor that changes nothing.
    placement: which layers run in fp8 (:class:`~jmp_lite.fp8.Fp8Placement`;
      default ``Fp8Placement()``: not the first and last matmul layers, nor
      matmuls too small to pay). Finding the first and last layers costs one
      more abstract trace of the model per trace.
    loss_scale: the loss scale the gradients carry, given to every fp8 op
      the interceptor runs (a number, a scalar array, a tracer inside ``jit``,
      a jmp_lite loss scale, or ``None``: 1), as in
      :func:`jmp_lite.fp8.dot_general`. Build the interceptor inside the loss
      function, where the loss scale is known.

  Returns:
    An interceptor for :func:`flax.linen.intercept_methods`.
  """
  config = config_of_spec(fp8_spec)
  placement = as_placement(placement)

  def layer_call(run: _Run, next_fun, args, kwargs, module):
    path = _path(module)
    if run.discovering:
      run.order.append((path, args[0] if args else kwargs.get("inputs")))
      return next_fun(*args, **kwargs)
    run.layers[path] = classes = tuple(run.classes)
    reason = placement.reason(path, classes, run.positions.get(path))
    if not run.decide(path, reason):
      return next_fun(*args, **kwargs)
    decide = None if placement.shape_rule is None else run.shape_rule(path)
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
      state, amax = _linen_variables(module, config)
      # Flax's own __call__, with the fp8 matmul injected.
      dot_general = _bound_dot_general(state, amax, config, loss_scale, decide)
      return _bound_copy(module, type(module), dot_general=dot_general)(*args, **kwargs)
    einsum = _bound_copy(
      module, _LinenFp8Einsum, fp8_config=config, fp8_loss_scale=loss_scale, fp8_decide=decide
    )
    return einsum(*args, **kwargs)

  def outermost(next_fun, args, kwargs, context):
    module = context.module
    where = f"{type(module).__name__} ({'init' if module.is_initializing() else 'apply'})"
    found = _discover(context, args, kwargs, placement) if placement.keep_first_last else {}
    run = _Run(placement, found, discovering=False)
    with _RUN.scope(run), run.inside(type(module)):
      if context.method_name == "__call__" and _is_layer(module):
        out = layer_call(run, next_fun, args, kwargs, module)
      else:
        out = next_fun(*args, **kwargs)
    check_patterns(placement, run.layers, type(module).__name__)
    if not module.is_initializing():  # init's batch may be smaller than the training one
      warn_if_no_fp8(run.reasons, where)
    return out

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if config is None or context.method_name == "setup":
      return next_fun(*args, **kwargs)
    run = _RUN.current()
    if run is None:
      return outermost(next_fun, args, kwargs, context)
    with run.inside(type(module)):
      if context.method_name == "__call__" and _is_layer(module):
        return layer_call(run, next_fun, args, kwargs, module)
      return next_fun(*args, **kwargs)

  return interceptor


@contextlib.contextmanager
def linen_fp8(
  fp8_spec: Any = None, *, loss_scale: Any = None, placement: Any = None
) -> Iterator[None]:
  """Runs the matmuls of linen Dense/DenseGeneral/Einsum layers in fp8.

  Use it around ``init`` (to create the ``"fp8_state"`` collection) and
  around ``apply``. Within a traced train step, pass the loss scale the
  gradients carry (``jl.get_loss_scale(opt_state)``) so the output-gradient
  scales compose with it.

  Args:
    fp8_spec: an fp8 recipe, an :class:`~jmp_lite.fp8.Fp8Policy` or a policy
      string, as in
      :func:`linen_interceptor`.
    loss_scale: the loss scale the gradients carry, given to the fp8 ops of
      the layers called inside (``None`` is 1), as in
      :func:`linen_interceptor`.
    placement: which layers run in fp8, as in :func:`linen_interceptor`.

  Returns:
    A context manager.
  """
  with nn.intercept_methods(linen_interceptor(fp8_spec, placement, loss_scale=loss_scale)):
    yield
