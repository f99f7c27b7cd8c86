"""fp8 matmuls for linen layers, by interception or explicit injection (private)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmp_lite import fp8
from jmp_lite.flax.fp8._common import config_of_spec, loss_scale_scope, op_options
from jmp_lite.fp8._einsum import einsum_subscripts

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
      f"returned to apply (inside linen_fp8 at init too), or make it mutable."
    )
  if module.has_variable(AMAX_COLLECTION, VARIABLE_NAME):
    return state, module.get_variable(AMAX_COLLECTION, VARIABLE_NAME)
  return state, None


def _bound_dot_general(state, amax, config) -> Callable[..., jax.Array]:
  """A ``lax.dot_general``-compatible function running this layer's fp8 matmul."""

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    options = op_options(
      config,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=kw.get("out_sharding"),
    )
    return fp8.dot_general(lhs, rhs, dimension_numbers, state, amax, **options)

  return dot_general


class LinenFp8DotGeneral(nn.Module):
  """An fp8 matmul for linen's ``dot_general_cls`` slot (explicit injection).

  ``nn.Dense(16, dot_general_cls=functools.partial(LinenFp8DotGeneral,
  config=config))`` keeps its state and probe under the Dense's child
  ``LinenFp8DotGeneral_0`` in the same collections as :func:`linen_fp8`, and
  reads the loss scale from :func:`loss_scale_scope`.

  Attributes:
    config: the fp8 recipe (``CurrentScaling()`` by default).
  """

  config: Any = fp8.CurrentScaling()

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
    return _bound_dot_general(state, amax, config)(
      lhs, rhs, dimension_numbers, precision, preferred_element_type
    )


def _linen_einsum(module: nn.Einsum, config: Any, inputs, einsum_str=None):
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
    _, rhs, out = einsum_subscripts(einsum_str, jnp.ndim(inputs), len(module.shape))
    bias_shape = tuple(module.shape[rhs.index(c)] for c in out if c in rhs)
    broadcast_shape = tuple(module.shape[rhs.index(c)] if c in rhs else 1 for c in out)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  promote = getattr(module, "promote_dtype", nn.dtypes.promote_dtype)
  inputs, kernel, bias = promote(inputs, kernel, bias, dtype=module.dtype)
  state, amax = _linen_variables(module, config)
  options = op_options(
    config, preferred_element_type=getattr(module, "preferred_element_type", None)
  )
  y = fp8.einsum(einsum_str, inputs, kernel, state, amax, **options)
  if bias is not None:
    y = y + jnp.reshape(bias, broadcast_shape)
  return y


class _LinenFp8Einsum(nn.Einsum):
  """``nn.Einsum`` computing in fp8; what the interceptor calls in place of an Einsum."""

  fp8_config: Any = fp8.CurrentScaling()

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
  reads the loss scale from :func:`loss_scale_scope` at call time. Layers
  whose user already set ``dot_general``/``dot_general_cls`` keep it, and so
  do subclasses of ``nn.Einsum`` (they may compute something else).

  Args:
    fp8_spec: an fp8 recipe (default :class:`~jmp_lite.fp8.CurrentScaling`;
      an :class:`~jmp_lite.fp8.Fp8Config` is delayed scaling), an
      :class:`~jmp_lite.fp8.Fp8Policy`, or a policy string such as
      ``"p=f32,c=bf16,o=f32,fp8=hybrid"``. A policy without fp8 gives an
      interceptor that changes nothing.

  Returns:
    An interceptor for :func:`flax.linen.intercept_methods`.
  """
  config = config_of_spec(fp8_spec)

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
    fp8_spec: an fp8 recipe, an :class:`~jmp_lite.fp8.Fp8Policy` or a policy
      string, as in
      :func:`linen_interceptor`.
    loss_scale: the loss scale the gradients carry, as in
      :func:`loss_scale_scope`; set for the code inside (``None`` is 1, and
      shadows an outer :func:`loss_scale_scope`).

  Returns:
    A context manager.
  """
  with nn.intercept_methods(linen_interceptor(fp8_spec)), loss_scale_scope(loss_scale):
    yield
