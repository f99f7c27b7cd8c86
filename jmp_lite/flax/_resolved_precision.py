"""The precision one module call runs in, resolved from a ModulePolicies (private).

:func:`resolve` applies the rules of :class:`~jmp_lite.flax.ModulePolicies`
to one module in its context (the module around it): its class's override,
inherited compute dtypes, islands, the module's own ``dtype=`` and the kernel
hooks; :func:`resolve_module` does it for a module instance, reading its
``dtype``. :func:`attribute_updates` turns the result into the attributes set
on the module while it runs. Both integrations (linen's interceptor, NNX's
view) call them for every module.

Nothing is cached: a resolution is a walk along the class's MRO and a few
comparisons, once per module call traced, which is negligible next to the
trace of the model that asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jmp_lite._matmul_precision import is_16bit_float
from jmp_lite.flax._frozen_mapping import FrozenMapping
from jmp_lite.flax._kernel_hooks import FLAX_HOOKS, KernelHook, kernel_updates
from jmp_lite.flax._module_policy import ModulePolicies

_F32 = np.dtype(jnp.float32)


class ResolvedPrecision(NamedTuple):
  """The precision one module runs in: its class's override, in its context.

  Attributes:
    compute_dtype: of its inputs and parameters as read; inherited by the
      submodules without an override of their own.
    output_dtype: of the outputs of an inner call (by default the enclosing
      module's compute dtype).
    root_output_dtype: of the outputs of the outermost call (by default the
      policy's output dtype).
    attributes: the attributes its :class:`~jmp_lite.flax.ModuleOverride` sets.
    hooks: the kernel hooks (:data:`~jmp_lite.flax.FLAX_HOOKS` entries) it
      gets (16-bit compute only).
    recompute: whether it runs under :func:`jax.checkpoint` (an island that
      asked for it).
    policy_dtype: the compute dtype the policy alone gives it (its own
      ``dtype=`` aside).
    explicit_dtype: its own ``dtype=`` where that differs from
      ``policy_dtype``; ``None`` otherwise.
  """

  compute_dtype: np.dtype
  output_dtype: np.dtype
  root_output_dtype: np.dtype
  attributes: Mapping[str, Any]
  hooks: tuple[KernelHook, ...]
  recompute: bool
  policy_dtype: np.dtype
  explicit_dtype: np.dtype | None = None


def resolve(
  policies: ModulePolicies,
  cls: type,
  parent: ResolvedPrecision | None = None,
  dtype: np.dtype | None = None,
) -> ResolvedPrecision:
  """Returns the precision of a module of class ``cls`` called inside ``parent``.

  Args:
    policies: what the model runs under.
    cls: the module's class.
    parent: the :class:`ResolvedPrecision` of the enclosing module; ``None``
      at the top, where the policy's compute dtype is the context.
    dtype: the module's own ``dtype`` attribute (:func:`explicit_dtype`), if any.

  Returns:
    Its :class:`ResolvedPrecision`.
  """
  global_compute = np.dtype(policies.policy.compute_dtype)
  context = parent.compute_dtype if parent is not None else global_compute
  policy_context = parent.policy_dtype if parent is not None else global_compute
  override = policies.module_override(cls)
  attributes: Mapping[str, Any] = override.attributes if override else FrozenMapping()
  # What the policy alone asks for; the warning compares the module's dtype with it.
  if override is None:
    policy_dtype = policy_context
  else:
    policy_dtype = override.compute_dtype or global_compute
  explicit = None
  if dtype is not None and dtype != policy_dtype and "dtype" not in attributes:
    explicit = dtype
  output = override.output_dtype if override else None
  if explicit is not None and policies.explicit_dtypes != "policy":
    # The module computes in its own dtype whatever is cast: make it an island of
    # that dtype, so that its parameters are read unrounded and its inputs arrive
    # in the dtype it computes in.
    compute = explicit
  elif override is None:  # inherit the context
    compute = context
  else:
    compute = policy_dtype
  recompute = bool(override and override.recompute) and compute != context
  hooks: tuple[KernelHook, ...] = ()
  if is_16bit_float(compute):
    enabled = {"accumulation": policies.fp32_accumulation, "softmax": policies.fp32_softmax}
    hooks = tuple(
      h
      for h in FLAX_HOOKS
      if issubclass(cls, h.cls) and enabled[h.kind] and h.attribute not in attributes
    )
  root_output = output or np.dtype(policies.policy.output_dtype)
  return ResolvedPrecision(
    compute, output or context, root_output, attributes, hooks, recompute, policy_dtype, explicit
  )


def resolve_module(
  policies: ModulePolicies, module: Any, parent: ResolvedPrecision | None = None
) -> ResolvedPrecision:
  """Returns the precision of ``module`` called inside ``parent``, from its class and ``dtype``.

  Args:
    policies: what the model runs under.
    module: a linen or NNX module.
    parent: as for :func:`resolve`.

  Returns:
    :func:`resolve` of its class and its own ``dtype`` (:func:`explicit_dtype`).
  """
  return resolve(policies, type(module), parent, explicit_dtype(module))


def attribute_updates(
  policies: ModulePolicies,
  module: Any,
  resolved: ResolvedPrecision | None = None,
  *,
  wide_output: bool = False,
) -> dict[str, Any]:
  """Returns the attributes to set on ``module`` while it runs.

  Args:
    policies: what the model runs under.
    module: a linen or NNX module.
    resolved: its :class:`ResolvedPrecision` (default: the one at the top).
    wide_output: whether the module's output is the model's output, in the
      policy's output dtype; its matmul then produces that dtype directly.

  Returns:
    ``{attribute: value}``: jmp_lite's kernels where the module still has
    Flax's default, its ``dtype`` under ``explicit_dtypes="policy"``, then
    the attributes of its :class:`~jmp_lite.flax.ModuleOverride` (which win).

  Raises:
    AttributeError: if its :class:`~jmp_lite.flax.ModuleOverride` sets an
      attribute the module does not have.
  """
  resolved = resolved or resolve_module(policies, module)
  options: dict[str, Any] = {}
  if policies.grad_reduction_dtype is not None:
    options["rhs_grad_dtype"] = policies.grad_reduction_dtype
  if wide_output and np.dtype(resolved.root_output_dtype) == _F32:
    options["output_dtype"] = _F32
  updates = kernel_updates(resolved.hooks, module, options)
  if resolved.explicit_dtype is not None and policies.explicit_dtypes == "policy":
    updates["dtype"] = resolved.compute_dtype
  for name, value in resolved.attributes.items():
    if not hasattr(module, name):
      raise AttributeError(
        f"ModuleOverride for {type(module).__name__} sets attribute {name!r}, which "
        f"{type(module).__name__} does not have."
      )
    updates[name] = value
  return updates


def explicit_dtype(module: Any) -> np.dtype | None:
  """Returns the floating dtype a module was built with (its ``dtype`` attribute).

  Read from the instance's ``__dict__``: a linen module's ``__getattr__``
  would run its ``setup`` for a missing name.

  Args:
    module: a linen or NNX module.

  Returns:
    Its ``dtype`` as an ``np.dtype`` if that is a floating dtype; ``None`` if
    it has none, ``None`` (Flax's default) or another kind of ``dtype``.
  """
  value = getattr(module, "__dict__", {}).get("dtype")
  if value is None:
    return None
  try:
    dtype = np.dtype(value)
  except (TypeError, ValueError):  # some other meaning of "dtype"
    return None
  return dtype if jnp.issubdtype(dtype, jnp.floating) else None
