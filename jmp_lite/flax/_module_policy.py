"""The whole precision configuration a Flax model runs under (private).

As with Haiku's per-module-class policies, :class:`ModulePolicies` holds a
global :class:`~jmp_lite.Policy` and maps module classes to a
:class:`~jmp_lite.flax.ModuleOverride`; a module uses the entry of its most
specific class (first match along its MRO). A module whose class has no entry
follows the closest enclosing module that has one, and the global policy at
the top (the rules are in ``jmp_lite.flax._resolved_precision``).

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
``jmp_lite.flax._module_call``.)

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
inside it inherit it), and an :class:`~jmp_lite.flax.ExplicitDtypeWarning`
names every such module; ``explicit_dtypes="policy"`` lets the policy set
their ``dtype`` instead, ``explicit_dtypes="keep"`` keeps them without the warning.

The entry points (:func:`~jmp_lite.flax.policy_apply`,
:func:`~jmp_lite.flax.policy_init`, :func:`~jmp_lite.flax.policy_view`) take
one ``policy``: a :class:`ModulePolicies`, or a :class:`~jmp_lite.Policy` or
policy string meaning ``ModulePolicies(policy)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite._matmul_precision import is_16bit_float
from jmp_lite._policy import Policy, get_policy
from jmp_lite.flax._frozen_mapping import FrozenMapping
from jmp_lite.flax._module_override import DEFAULT_OVERRIDES, ModuleOverride

P = ParamSpec("P")
R = TypeVar("R")

_F32 = np.dtype(jnp.float32)

_EXPLICIT_DTYPES = ("warn", "keep", "policy")


def _check_grad_reduction_dtype(value: Any) -> np.dtype | None:
  if value is None:
    return None
  expected = "None (the compute dtype) or float32"
  f32 = lambda d: d == _F32
  return _validation.check_dtype(value, "grad_reduction_dtype", f32, expected, as_given=True)


def _override_entry(cls: Any, value: Any) -> ModuleOverride | None:
  """One entry of ``overrides`` validated: a ModuleOverride, or None (no override)."""
  if not (isinstance(cls, type) and issubclass(cls, (nn.Module, nnx.Module))):
    raise TypeError(f"override keys must be Flax linen or NNX module classes, got {cls!r}.")
  if value is None or isinstance(value, ModuleOverride):
    return value
  if isinstance(value, Policy):
    raise TypeError(
      f"override for {cls.__name__} is a Policy; use ModuleOverride(compute_dtype=..., "
      "output_dtype=...): parameters are stored in the global policy's param dtype."
    )
  try:
    return ModuleOverride(compute_dtype=value)
  except (TypeError, ValueError) as e:
    raise type(e)(f"override for {cls.__name__}: {e}") from e


@dataclasses.dataclass(frozen=True, repr=False)
class ModulePolicies:
  """A precision policy with per-module-class overrides and kernel options.

  The whole configuration :func:`~jmp_lite.flax.policy_apply`,
  :func:`~jmp_lite.flax.policy_init` and :func:`~jmp_lite.flax.policy_view`
  run a model under: pass one as their ``policy``. A frozen dataclass,
  hashable and comparable field by field (dtypes compared by value, so
  ``"f32"`` and ``jnp.float32`` are equal); change a setting with
  :func:`dataclasses.replace`.

  A module whose class (or a base class) has an override computes in the
  override's dtype and returns its ``output_dtype`` (default: the dtype of the
  module around it). A module without one inherits the compute dtype of the
  closest enclosing module that has one (linen: the calling module; NNX: the
  module holding it), or the policy's at the top: overriding a block class
  runs the whole block in that dtype, and a LayerNorm inside an fp32 block
  returns fp32 to it.

  Attributes:
    policy: the global :class:`~jmp_lite.Policy` (given as one or as a policy
      string).
    overrides: ``{module_class: ModuleOverride | None}``, taken over
      :data:`~jmp_lite.flax.DEFAULT_OVERRIDES` (see :meth:`module_override`);
      given, a dtype ``d`` means ``ModuleOverride(compute_dtype=d)``. ``None``
      means no override for that class and its subclasses (they follow the
      policy, or the enclosing module), e.g. ``{nn.LayerNorm: None}``.
    use_default_overrides: start from :data:`~jmp_lite.flax.DEFAULT_OVERRIDES`
      (default) or from no overrides.
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
      override inherit it), and an :class:`~jmp_lite.flax.ExplicitDtypeWarning`
      names it. ``"keep"``: the same, silently (the dtypes are deliberate).
      ``"policy"``: its ``dtype`` is set to the policy's compute dtype while it
      runs. A ``ModuleOverride`` whose ``attributes`` set ``dtype`` decides for
      its class.

  Raises:
    TypeError: for a ``policy`` that is not a Policy or policy string, an
      override key that is not a Flax module class, a value that is not a
      ModuleOverride, dtype or None, or a switch that is not a bool.
    ValueError: for an fp8 compute dtype (use jmp_lite's fp8 support), an
      unknown dtype name, an ``explicit_dtypes`` not in ``"warn"``, ``"keep"``,
      ``"policy"``, or a ``grad_reduction_dtype`` other than fp32 (or with
      ``fp32_accumulation=False``).

  >>> import dataclasses
  >>> import flax.linen as nn
  >>> policies = jl.flax.ModulePolicies("p=f32,c=bf16,o=f32", {nn.Dense: "f32"})
  >>> policies.module_override(nn.Dense), policies.module_override(nn.Conv)
  (ModuleOverride(compute_dtype=dtype('float32'), ...), None)
  >>> dataclasses.replace(policies, fp32_softmax=False).fp32_softmax
  False
  """

  policy: Policy
  overrides: Mapping[type, ModuleOverride | None] = FrozenMapping()
  _: dataclasses.KW_ONLY
  use_default_overrides: bool = True
  fp32_accumulation: bool = True
  fp32_softmax: bool = True
  op_table: bool = True
  grad_reduction_dtype: np.dtype | None = None
  explicit_dtypes: str = "warn"

  if TYPE_CHECKING:  # The dataclass __init__ accepts these; __post_init__ parses them.

    def __init__(
      self,
      policy: Policy | str,
      overrides: Mapping[type, ModuleOverride | dtypes.DTypeLike | None] | None = None,
      *,
      use_default_overrides: bool = True,
      fp32_accumulation: bool = True,
      fp32_softmax: bool = True,
      op_table: bool = True,
      grad_reduction_dtype: dtypes.DTypeLike | None = None,
      explicit_dtypes: str = "warn",
    ) -> None: ...

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    if not isinstance(self.policy, (Policy, str)):
      raise TypeError(
        f"ModulePolicies expects a jmp_lite.Policy or a policy string, got {self.policy!r}."
      )
    set_("policy", get_policy(self.policy))
    if dtypes.is_float8(self.policy.compute_dtype):
      raise ValueError(
        f"Policy {self.policy} computes in fp8, which needs per-tensor scaling that casting "
        "Flax modules cannot provide; use jmp_lite's fp8 matmuls for fp8 compute."
      )
    overrides = {} if self.overrides is None else self.overrides
    if not isinstance(overrides, Mapping):
      raise TypeError(
        f"overrides must be a mapping from module class to ModuleOverride, got {overrides!r}."
      )
    set_("overrides", FrozenMapping({c: _override_entry(c, v) for c, v in overrides.items()}))
    for name in ("use_default_overrides", "fp32_accumulation", "fp32_softmax", "op_table"):
      set_(name, _validation.check_bool(getattr(self, name), name))
    set_("grad_reduction_dtype", _check_grad_reduction_dtype(self.grad_reduction_dtype))
    set_(
      "explicit_dtypes",
      _validation.check_choice(
        self.explicit_dtypes, "explicit_dtypes", _EXPLICIT_DTYPES, type_error=False
      ),
    )
    if self.grad_reduction_dtype is not None and not self.fp32_accumulation:
      raise ValueError(
        "grad_reduction_dtype needs jmp_lite's kernels, which fp32_accumulation=False switches "
        "off; keep fp32_accumulation=True or drop grad_reduction_dtype."
      )

  def __repr__(self) -> str:
    # The policy as its string, then only the settings away from their defaults.
    shown = [str(self.policy)]
    for field in dataclasses.fields(self)[1:]:
      value = getattr(self, field.name)
      if value != field.default:
        if field.name == "overrides":
          value = "{" + ", ".join(f"{c.__qualname__}: {v!r}" for c, v in value.items()) + "}"
        else:
          value = repr(value)
        shown.append(f"{field.name}={value}")
    return f"ModulePolicies({', '.join(shown)})"

  def module_override(self, cls: type) -> ModuleOverride | None:
    """Returns the override that applies to the modules of class ``cls``.

    Args:
      cls: a Flax module class.

    Returns:
      The entry of ``cls``'s most specific class (along its MRO) in
      :attr:`overrides` or, with ``use_default_overrides``, in
      :data:`~jmp_lite.flax.DEFAULT_OVERRIDES` (:attr:`overrides` first);
      ``None`` if there is none, or if that entry is an explicit ``None``.
    """
    for base in cls.__mro__:
      if base in self.overrides:
        return self.overrides[base]
      if self.use_default_overrides and base in DEFAULT_OVERRIDES:
        return DEFAULT_OVERRIDES[base]
    return None


def rewrites_model_ops(policies: ModulePolicies) -> bool:
  """Whether the entry points apply the op table: ``op_table`` is on and some module
  computes in 16 bits (the policy's compute dtype or an override's)."""
  overrides = [*policies.overrides.values()]
  if policies.use_default_overrides:
    overrides += DEFAULT_OVERRIDES.values()
  computes = [policies.policy.compute_dtype] + [o.compute_dtype for o in overrides if o]
  return policies.op_table and any(d is not None and is_16bit_float(d) for d in computes)


def as_module_policies(policy: ModulePolicies | Policy | str, caller: str) -> ModulePolicies:
  """An entry point's ``policy`` as a :class:`ModulePolicies`.

  Args:
    policy: a :class:`ModulePolicies`, or a :class:`~jmp_lite.Policy` or
      policy string (``ModulePolicies(policy)``: the defaults).
    caller: the entry point, for the message.

  Returns:
    ``policy`` itself if it is a ``ModulePolicies``, otherwise ``ModulePolicies(policy)``.

  Raises:
    TypeError: for a ``policy`` of another type (and as :class:`ModulePolicies`).
  """
  if isinstance(policy, ModulePolicies):
    return policy
  _validation.check_type(
    policy,
    (Policy, str),
    f"{caller} expects a policy: a jmp_lite.Policy, a policy string or a "
    "jmp_lite.flax.ModulePolicies",
  )
  return ModulePolicies(policy)


def options_on_the_policy(entry_point: Callable[P, R]) -> Callable[P, R]:
  """``entry_point``, refusing a keyword it does not take by saying where options go.

  The entry points take their options on a :class:`ModulePolicies` only; a
  keyword such as ``overrides=`` passed to one raises a TypeError that names
  it and shows the ``ModulePolicies`` to build (Python's own error would name
  the keyword only).

  Args:
    entry_point: :func:`~jmp_lite.flax.policy_apply`, ``policy_init`` or ``policy_view``.

  Returns:
    ``entry_point``, with the same signature.
  """
  accepted = inspect.signature(entry_point).parameters
  options = [f.name for f in dataclasses.fields(ModulePolicies)[1:]]

  @functools.wraps(entry_point)
  def checked(*args: P.args, **kwargs: P.kwargs) -> R:
    unknown = [name for name in kwargs if name not in accepted]
    if unknown:
      name = entry_point.__name__
      message = (
        f"{name}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: it "
        f"takes ({', '.join(accepted)}), and options go on the policy"
      )
      given = [k for k in unknown if k in options]
      if given:
        keywords = ", ".join(f"{k}=..." for k in given)
        message += f": {name}(..., jl.flax.ModulePolicies(policy, {keywords}))"
      raise TypeError(f"{message}. ModulePolicies takes {', '.join(options)}.")
    return entry_point(*args, **kwargs)

  return checked
