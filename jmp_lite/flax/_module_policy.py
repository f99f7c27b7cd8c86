"""Per-module-class precision: which dtype each kind of Flax module computes in.

A :class:`~jmp_lite.Policy` says "parameters fp32, compute bf16, outputs
fp32". Some layers must not follow it: normalization statistics (a variance
of bf16 values is a difference of nearly equal large numbers) and embedding
gradients (a scatter-add of many rows in bf16 drops the small ones). As with
Haiku's per-module-class policies, :class:`ModulePolicies` maps module classes
to a :class:`ModulePolicy`; a module uses the entry of its most specific
class (first match along its MRO). A module whose class has no entry follows
the closest enclosing module that has one, and the global policy at the top.

Every module *call* under a policy then does:

* floating inputs are cast to the module's compute dtype;
* its own parameters are read in the module's compute dtype (they are stored,
  and created, in the policy's param dtype);
* floating outputs are cast to the module's output dtype: by default the
  compute dtype of the module around it, so an fp32 island hands 16-bit
  activations to the next layer, and the policy's output dtype for the
  outermost call (e.g. fp32 logits for the loss);
* an island marked ``recompute`` runs under :func:`jax.checkpoint`, storing
  only its 16-bit inputs for the backward pass.

(The call wrapper that does this, shared by linen and NNX, is in
``jmp_lite.flax._module_call``; :class:`ModulePolicies` decides the dtypes.)

On top of dtypes, Flax's built-in layers get 16-bit-friendly kernels in place
of Flax's defaults, only where the layer still uses the default:
jmp_lite's ``dot_general``/``conv_general_dilated``/``einsum_op``
(:func:`~jmp_lite.flax.dot_general`: the fp32 output layer, the TPU declaration,
``grad_reduction_dtype``) and the fp32-softmax ``attention_fn``
(:func:`~jmp_lite.flax.dot_product_attention`); see :data:`~jmp_lite.flax.FLAX_HOOKS`.

A module built with an explicit ``dtype=`` other than the compute dtype the
policy gives it (Flax's examples thread ``dtype=jnp.float32`` through every
layer) computes in that dtype whatever the policy says. By default it keeps
its dtype, as an island (inputs and parameters in that dtype, and the modules
inside it inherit it), and an :class:`ExplicitDtypeWarning` names every such
module; ``explicit_dtypes="policy"`` lets the policy set their ``dtype``
instead, ``explicit_dtypes="keep"`` keeps them without the warning.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite._matmul_precision import is_16bit_float
from jmp_lite._policy import Policy, get_policy
from jmp_lite.flax import _accumulate as accumulate
from jmp_lite.flax._kernel_hooks import FLAX_HOOKS, KernelHook, kernel_updates

_F32 = np.dtype(jnp.float32)

_EXPLICIT_DTYPES = ("warn", "keep", "policy")


class ExplicitDtypeWarning(UserWarning):
  """Modules built with an explicit ``dtype=`` compute in it, not in the policy's dtype.

  Issued once per trace by :func:`~jmp_lite.flax.policy_apply`,
  :func:`~jmp_lite.flax.policy_init` and :func:`~jmp_lite.flax.policy_view`
  (with ``explicit_dtypes="warn"``, the default), naming every such module.
  """


def _check_grad_reduction_dtype(value: Any) -> np.dtype | None:
  if value is None:
    return None
  expected = "None (the compute dtype) or float32"
  f32 = lambda d: d == _F32
  return _validation.check_dtype(value, "grad_reduction_dtype", f32, expected, as_given=True)


def _check_dtype(value: Any, name: str) -> np.dtype | None:
  if value is None:
    return None
  expected = (
    "a floating dtype other than fp8 (fp8 needs per-tensor scaling, which a module policy does "
    "not provide; use jmp_lite's fp8 matmuls for fp8 compute)"
  )
  return _validation.check_dtype(value, name, lambda d: not dtypes.is_float8(d), expected)


@dataclasses.dataclass(frozen=True)
class ModulePolicy:
  """How the modules of one class run under a precision policy.

  Attributes:
    compute_dtype: dtype of the module's inputs and of its parameters as read
      (and of its submodules without an override of their own); ``None``
      means the policy's compute dtype.
    output_dtype: dtype of its outputs; ``None`` means the compute dtype of
      the enclosing module (the policy's compute dtype at the top, the
      policy's output dtype for the outermost call), so that the next layer
      receives activations in the dtype it computes in.
    attributes: module attributes (dataclass fields in linen, attributes in
      NNX) to set while the module runs, e.g. ``{"precision": "highest"}``.
      They take precedence over jmp_lite's kernels (see
      :class:`ModulePolicies`).
    recompute: for an island (a compute dtype other than the enclosing one),
      run the module under :func:`jax.checkpoint`: the backward pass
      recomputes its forward from its narrow inputs instead of keeping its
      wide intermediates (what that saves for a LayerNorm: the Flax guide's
      "Recomputed islands"), for one more forward pass of the module. Only
      for modules that neither update variables nor draw random numbers
      (normalization without running statistics).

  >>> ModulePolicy(compute_dtype="f32").compute_dtype
  dtype('float32')
  """

  compute_dtype: np.dtype | None = None
  output_dtype: np.dtype | None = None
  attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  recompute: bool = False

  def __post_init__(self):
    object.__setattr__(self, "compute_dtype", _check_dtype(self.compute_dtype, "compute_dtype"))
    object.__setattr__(self, "output_dtype", _check_dtype(self.output_dtype, "output_dtype"))
    if not isinstance(self.attributes, Mapping):
      raise TypeError(
        f"attributes must be a mapping from attribute name to value, got {self.attributes!r}."
      )
    for name in self.attributes:
      if not (isinstance(name, str) and name.isidentifier()):
        raise TypeError(f"attribute names must be identifiers, got {name!r}.")
    # Read-only and hashable, so that a ModulePolicy can be static (jit, NNX graphdef).
    object.__setattr__(self, "attributes", types.MappingProxyType(dict(self.attributes)))
    object.__setattr__(self, "recompute", _validation.check_bool(self.recompute, "recompute"))

  def _key(self):
    return (self.compute_dtype, self.output_dtype, tuple(self.attributes.items()), self.recompute)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    if not isinstance(other, ModulePolicy):
      return NotImplemented
    return self._key() == other._key()


FP32 = ModulePolicy(compute_dtype=_F32)
"""Compute in fp32 (inputs and parameters), hand the result back in the compute dtype."""

FP32_RECOMPUTED = ModulePolicy(compute_dtype=_F32, recompute=True)
"""As :data:`FP32`, recomputed in the backward pass instead of storing fp32 intermediates."""

DEFAULT_OVERRIDES: Mapping[type, ModulePolicy] = types.MappingProxyType(
  {
    # Normalization: mean/variance of 16-bit activations cancel catastrophically.
    # Recomputed (cheap elementwise work) so the island stores only its 16-bit
    # input; BatchNorm updates running statistics, so it stores its fp32
    # intermediates instead.
    nn.LayerNorm: FP32_RECOMPUTED,
    nn.RMSNorm: FP32_RECOMPUTED,
    nn.GroupNorm: FP32_RECOMPUTED,
    nn.InstanceNorm: FP32_RECOMPUTED,
    nn.BatchNorm: FP32,
    nnx.LayerNorm: FP32_RECOMPUTED,
    nnx.RMSNorm: FP32_RECOMPUTED,
    nnx.GroupNorm: FP32_RECOMPUTED,
    nnx.InstanceNorm: FP32_RECOMPUTED,
    nnx.BatchNorm: FP32,
    # Embeddings: a gather is exact in any dtype, so reading the fp32 table and
    # rounding the gathered rows gives the same activations as a bf16 table,
    # while the backward scatter-add of many rows accumulates in fp32 and no
    # 16-bit copy of the table is made. (A tied ``attend`` then runs in fp32.)
    nn.Embed: FP32,
    nnx.Embed: FP32,
  }
)
"""Module classes that keep fp32 under any policy unless overridden.

Attention softmax and the loss are fp32 islands too, but not by class: the
softmax through :func:`jmp_lite.flax.dot_product_attention`, which replaces
the attention modules' default ``attention_fn``, and the loss because the
model's output is cast to the policy's output dtype.
"""


class ModulePrecision(NamedTuple):
  """The precision one module runs in: its class's override, in its context.

  Attributes:
    compute_dtype: of its inputs and parameters as read; inherited by the
      submodules without an override of their own.
    output_dtype: of the outputs of an inner call (by default the enclosing
      module's compute dtype).
    root_output_dtype: of the outputs of the outermost call (by default the
      policy's output dtype).
    attributes: the attributes its :class:`ModulePolicy` sets.
    hooks: the kernel hooks (:data:`FLAX_HOOKS` entries) it gets (16-bit compute
      only).
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


def _override_table(
  overrides: Mapping[type, ModulePolicy | dtypes.DTypeLike | None] | None,
  use_default_overrides: bool,
) -> Mapping[type, ModulePolicy | None]:
  """``overrides`` validated, each value a ModulePolicy or None, merged over the defaults."""
  if overrides is not None and not isinstance(overrides, Mapping):
    raise TypeError(
      f"overrides must be a mapping from module class to ModulePolicy, got {overrides!r}."
    )
  table: dict[type, ModulePolicy | None] = dict(DEFAULT_OVERRIDES) if use_default_overrides else {}
  for cls, value in (overrides or {}).items():
    if not (isinstance(cls, type) and issubclass(cls, (nn.Module, nnx.Module))):
      raise TypeError(f"override keys must be Flax linen or NNX module classes, got {cls!r}.")
    if value is None:
      # An explicit "no override": stops the search along the MRO too, so a
      # LayerNorm subclass mapped to None follows the policy.
      table[cls] = None
    elif isinstance(value, ModulePolicy):
      table[cls] = value
    elif isinstance(value, Policy):
      raise TypeError(
        f"override for {cls.__name__} is a Policy; use ModulePolicy(compute_dtype=..., "
        "output_dtype=...): parameters are stored in the global policy's param dtype."
      )
    else:
      try:
        table[cls] = ModulePolicy(compute_dtype=value)
      except (TypeError, ValueError) as e:
        raise type(e)(f"override for {cls.__name__}: {e}") from e
  return types.MappingProxyType(table)


# The options of ModulePolicies besides the overrides, with their defaults (shown by repr).
_OPTION_DEFAULTS = {
  "fp32_accumulation": True,
  "fp32_softmax": True,
  "op_table": True,
  "grad_reduction_dtype": None,
  "explicit_dtypes": "warn",
}


class ModulePolicies:
  """A precision policy with per-module-class overrides and kernel options.

  The whole configuration :func:`~jmp_lite.flax.policy_apply`,
  :func:`~jmp_lite.flax.policy_init` and :func:`~jmp_lite.flax.policy_view`
  run a model under: pass one as their ``policy``. Immutable and hashable;
  two are equal when every setting is (``explicit_dtypes`` included).

  A module whose class (or a base class) has an override computes in the
  override's dtype and returns its ``output_dtype`` (default: the dtype of the
  module around it). A module without one inherits the compute dtype of the
  closest enclosing module that has one (linen: the calling module; NNX: the
  module holding it), or the policy's at the top: overriding a block class
  runs the whole block in that dtype, and a LayerNorm inside an fp32 block
  returns fp32 to it.

  Args:
    policy: the global :class:`~jmp_lite.Policy` (or a policy string).
    overrides: ``{module_class: ModulePolicy | dtype | None}`` merged over
      :data:`DEFAULT_OVERRIDES`; a dtype ``d`` means ``ModulePolicy(compute_dtype=d)``
      and ``None`` means no override for that class and its subclasses (they
      follow the policy, or the enclosing module), e.g. ``{nn.LayerNorm: None}``.
    use_default_overrides: start from :data:`DEFAULT_OVERRIDES` (default) or
      from no overrides.
    fp32_accumulation: give Flax's dense, convolution and einsum layers
      jmp_lite's kernels when they compute in 16 bits: 16-bit matmuls, which
      every backend accumulates in fp32 (stated in the program on TPU; see
      :func:`~jmp_lite.flax.dot_general`), and an fp32 result for the layer
      that produces the model's fp32 output (the logits before the loss).
    fp32_softmax: give Flax's attention layers
      :func:`~jmp_lite.flax.dot_product_attention` (an fp32 softmax keeping
      16-bit residuals) when they compute in 16 bits.
    op_table: apply :func:`~jmp_lite.autocast`'s op table to the operations
      the model writes itself, inside and between its modules: under a 16-bit
      policy a ``jax.nn.softmax``, the ``exp``/``log``/``rsqrt`` and the long
      sums (``jnp.mean``, ``jnp.var``) of a hand-written norm compute in fp32
      (16-bit residuals kept; docs/autocast.md). Matmuls keep the operands
      their module gives them. ``False`` runs the model's own operations at
      the dtypes its inputs have.
    grad_reduction_dtype: ``None`` (default) or ``float32``: the dtype in which
      the kernel gradients of 16-bit dense, convolution and einsum layers
      leave their matmuls, hence the dtype of their cross-device reduction
      under data parallelism or FSDP. ``None`` keeps the compute dtype, as
      Flax's 16-bit layers do; ``float32`` reduces in fp32 (twice the bytes)
      and rounds the sum once to the compute dtype.
    explicit_dtypes: what happens to a module whose own ``dtype`` attribute
      (``nn.Dense(..., dtype=jnp.float32)``) differs from the compute dtype the
      policy gives it. ``"warn"`` (default): it keeps its dtype, as an island
      (inputs and its parameters in that dtype; modules inside it without an
      override inherit it), and an :class:`ExplicitDtypeWarning` names it.
      ``"keep"``: the same, silently (the dtypes are deliberate). ``"policy"``:
      its ``dtype`` is set to the policy's compute dtype while it runs. A
      ``ModulePolicy`` whose ``attributes`` set ``dtype`` decides for its class.

  Raises:
    TypeError: for an override key that is not a Flax module class, a value
      that is not a ModulePolicy, dtype or None, or a switch that is not a bool.
    ValueError: for an fp8 compute dtype (use jmp_lite's fp8 support), an
      unknown dtype name, an ``explicit_dtypes`` not in ``"warn"``, ``"keep"``,
      ``"policy"``, or a ``grad_reduction_dtype`` other than fp32 (or with
      ``fp32_accumulation=False``).

  >>> import flax.linen as nn
  >>> policies = jl.flax.ModulePolicies("p=f32,c=bf16,o=f32", {nn.Dense: "f32"})
  >>> [np.dtype(policies.resolve(cls).compute_dtype).name for cls in (nn.Dense, nn.Conv)]
  ['float32', 'bfloat16']
  >>> jl.flax.policy_apply(nn.Dense(2), policies, fp32_softmax=False)
  Traceback (most recent call last):
  ...
  ValueError: policy_apply: fp32_softmax=False conflicts with the ModulePolicies passed as ...
  """

  policy: Policy
  overrides: Mapping[type, ModulePolicy | None]  # the defaults merged in
  fp32_accumulation: bool
  fp32_softmax: bool
  op_table: bool
  grad_reduction_dtype: np.dtype | None
  explicit_dtypes: str
  _arguments: dict[str, Any]  # as given to __init__
  _cache: dict[tuple, ModulePrecision]  # resolve's results

  def __init__(
    self,
    policy: Policy | str,
    overrides: Mapping[type, ModulePolicy | dtypes.DTypeLike | None] | None = None,
    *,
    use_default_overrides: bool = True,
    fp32_accumulation: bool = True,
    fp32_softmax: bool = True,
    op_table: bool = True,
    grad_reduction_dtype: dtypes.DTypeLike | None = None,
    explicit_dtypes: str = "warn",
  ):
    policy = get_policy(policy)
    if dtypes.is_float8(policy.compute_dtype):
      raise ValueError(
        f"Policy {policy} computes in fp8, which needs per-tensor scaling that casting "
        "Flax modules cannot provide; use jmp_lite's fp8 matmuls for fp8 compute."
      )
    check_bool = _validation.check_bool
    fields = {
      "policy": policy,
      "overrides": _override_table(
        overrides, check_bool(use_default_overrides, "use_default_overrides")
      ),
      "fp32_accumulation": check_bool(fp32_accumulation, "fp32_accumulation"),
      "fp32_softmax": check_bool(fp32_softmax, "fp32_softmax"),
      "op_table": check_bool(op_table, "op_table"),
      "grad_reduction_dtype": _check_grad_reduction_dtype(grad_reduction_dtype),
      "explicit_dtypes": _validation.check_choice(
        explicit_dtypes, "explicit_dtypes", _EXPLICIT_DTYPES, type_error=False
      ),
    }
    if fields["grad_reduction_dtype"] is not None and not fields["fp32_accumulation"]:
      raise ValueError(
        "grad_reduction_dtype needs jmp_lite's kernels, which fp32_accumulation=False switches "
        "off; keep fp32_accumulation=True or drop grad_reduction_dtype."
      )
    # The arguments as given, to build this object again with some of them changed.
    arguments = {
      "overrides": None if overrides is None else dict(overrides),
      "use_default_overrides": use_default_overrides,
      "fp32_accumulation": fp32_accumulation,
      "fp32_softmax": fp32_softmax,
      "op_table": op_table,
      "grad_reduction_dtype": grad_reduction_dtype,
      "explicit_dtypes": explicit_dtypes,
    }
    for name, value in {**fields, "_arguments": arguments, "_cache": {}}.items():
      object.__setattr__(self, name, value)

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
      f"ModulePolicies is immutable; build a new one to change {name} (got {value!r})."
    )

  def _with(self, options: Mapping[str, Any]) -> ModulePolicies:
    """This object built again with some constructor keywords changed."""
    return ModulePolicies(self.policy, **{**self._arguments, **options})

  def _key(self):
    return (
      self.policy,
      tuple(
        sorted(
          (((c.__module__, c.__qualname__, id(c)), p) for c, p in self.overrides.items()),
          key=lambda item: item[0],
        )
      ),
      *(getattr(self, name) for name in _OPTION_DEFAULTS),
    )

  def __eq__(self, other):
    return isinstance(other, ModulePolicies) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in self.overrides)
    options = "".join(
      f", {name}={getattr(self, name)!r}"
      for name, default in _OPTION_DEFAULTS.items()
      if getattr(self, name) != default
    )
    return f"ModulePolicies({self.policy}, overrides=[{names}]{options})"

  def module_policy(self, cls: type) -> ModulePolicy | None:
    """Returns the override for module class ``cls``.

    Args:
      cls: a Flax module class.

    Returns:
      The entry of ``cls``'s most specific class (along its MRO) in
      :attr:`overrides`; ``None`` if there is none, or if that entry is an
      explicit ``None``.
    """
    for base in cls.__mro__:
      if base in self.overrides:
        return self.overrides[base]
    return None

  def resolve(
    self, cls: type, parent: ModulePrecision | None = None, dtype: np.dtype | None = None
  ) -> ModulePrecision:
    """Returns the precision of a module of class ``cls`` called inside ``parent``.

    Args:
      cls: the module's class.
      parent: the :class:`ModulePrecision` of the enclosing module; ``None``
        at the top, where the policy's compute dtype is the context.
      dtype: the module's own ``dtype`` attribute (:func:`explicit_dtype`),
        if any.

    Returns:
      Its :class:`ModulePrecision` (cached per class and context).
    """
    context = parent.compute_dtype if parent is not None else self.policy.compute_dtype
    policy_context = parent.policy_dtype if parent is not None else self.policy.compute_dtype
    key = (cls, context, policy_context, dtype)
    if key not in self._cache:
      self._cache[key] = _resolve(self, cls, context, policy_context, dtype)
    return self._cache[key]

  def attribute_updates(
    self, module: Any, resolved: ModulePrecision | None = None, *, wide_output: bool = False
  ) -> dict[str, Any]:
    """Returns the attributes to set on ``module`` while it runs.

    Args:
      module: a linen or NNX module.
      resolved: its :class:`ModulePrecision` (default: the one at the top).
      wide_output: whether the module's output is the model's output, in the
        policy's output dtype; its matmul then produces that dtype directly.

    Returns:
      ``{attribute: value}``: jmp_lite's kernels where the module still has
      Flax's default, its ``dtype`` under ``explicit_dtypes="policy"``, then
      the attributes of its :class:`ModulePolicy` (which win).

    Raises:
      AttributeError: if its :class:`ModulePolicy` sets an attribute the
        module does not have.
    """
    resolved = resolved or self.resolve(type(module), None, explicit_dtype(module))
    options: dict[str, Any] = {}
    if self.grad_reduction_dtype is not None:
      options["rhs_grad_dtype"] = self.grad_reduction_dtype
    if wide_output and np.dtype(resolved.root_output_dtype) == _F32:
      options["output_dtype"] = _F32
    updates = kernel_updates(resolved.hooks, module, options)
    if resolved.explicit_dtype is not None and self.explicit_dtypes == "policy":
      updates["dtype"] = resolved.compute_dtype
    for name, value in resolved.attributes.items():
      if not hasattr(module, name):
        raise AttributeError(
          f"ModulePolicy for {type(module).__name__} sets attribute {name!r}, which "
          f"{type(module).__name__} does not have."
        )
      updates[name] = value
    return updates


def _resolve(
  policies: ModulePolicies,
  cls: type,
  context: np.dtype,
  policy_context: np.dtype,
  dtype: np.dtype | None,
) -> ModulePrecision:
  """:meth:`ModulePolicies.resolve` without the cache.

  ``context`` is the compute dtype of the enclosing module, ``policy_context``
  the one the policy alone gives it.
  """
  override = policies.module_policy(cls)
  attributes: Mapping[str, Any] = override.attributes if override else types.MappingProxyType({})
  # What the policy alone asks for; the warning compares the module's dtype with it.
  if override is None:
    policy_dtype = policy_context
  else:
    policy_dtype = override.compute_dtype or policies.policy.compute_dtype
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
  if accumulate.is_16bit_float(compute):
    enabled = {"accumulation": policies.fp32_accumulation, "softmax": policies.fp32_softmax}
    hooks = tuple(
      h
      for h in FLAX_HOOKS
      if issubclass(cls, h.cls) and enabled[h.kind] and h.attribute not in attributes
    )
  root_output = output or policies.policy.output_dtype
  return ModulePrecision(
    compute, output or context, root_output, attributes, hooks, recompute, policy_dtype, explicit
  )


# The keywords policy_apply, policy_init and policy_view take beside a policy: those of
# ModulePolicies.
_OPTIONS = ("overrides", "use_default_overrides", *_OPTION_DEFAULTS)


def rewrites_model_ops(policies: ModulePolicies) -> bool:
  """Whether the entry points apply the op table: ``op_table`` is on and some module
  computes in 16 bits (the policy's compute dtype or an override's)."""
  computes = [policies.policy.compute_dtype] + [
    p.compute_dtype for p in policies.overrides.values() if p is not None
  ]
  return policies.op_table and any(d is not None and is_16bit_float(d) for d in computes)


def as_module_policies(
  policy: Policy | str | ModulePolicies, options: Mapping[str, Any], caller: str
) -> ModulePolicies:
  """Folds an entry point's ``policy`` and option keywords into one :class:`ModulePolicies`.

  Args:
    policy: a :class:`ModulePolicies`, a :class:`~jmp_lite.Policy` or a policy
      string.
    options: the keywords passed besides it (those of :class:`ModulePolicies`).
      With a ``ModulePolicies`` they must agree with it: a keyword whose
      value differs from its setting is refused.
    caller: the entry point, for the messages.

  Returns:
    ``policy`` itself if it is a ``ModulePolicies``, otherwise
    ``ModulePolicies(policy, **options)``.

  Raises:
    TypeError: for a ``policy`` of another type or an unknown keyword (and as
      :class:`ModulePolicies`).
    ValueError: for keywords that conflict with a given ``ModulePolicies`` (and
      as :class:`ModulePolicies`).
  """
  unknown = [name for name in options if name not in _OPTIONS]
  if unknown:
    raise TypeError(
      f"{caller} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; its "
      f"options are {', '.join(_OPTIONS)}."
    )
  if isinstance(policy, ModulePolicies):
    if options and policy._with(options) != policy:
      conflicts = [name for name in options if policy._with({name: options[name]}) != policy]
      given = ", ".join(f"{name}={options[name]!r}" for name in conflicts or options)
      raise ValueError(
        f"{caller}: {given} conflicts with the ModulePolicies passed as policy ({policy!r}). "
        "Set the options on the ModulePolicies, or pass a Policy with the keywords."
      )
    return policy
  if not isinstance(policy, (Policy, str)):
    raise TypeError(
      f"{caller} expects a policy: a jmp_lite.Policy, a policy string or a "
      f"jmp_lite.flax.ModulePolicies; got {policy!r} of type {type(policy).__name__}."
    )
  return ModulePolicies(policy, **options)


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
