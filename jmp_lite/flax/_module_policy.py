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

On top of dtypes, Flax's built-in layers get 16-bit-friendly kernels in place
of Flax's defaults, only where the layer still uses the default:
jmp_lite's ``dot_general``/``conv_general_dilated``/``einsum_op``
(:mod:`jmp_lite.flax.accumulate`: the fp32 output layer, the TPU declaration,
``grad_reduction_dtype``) and the fp32-softmax ``attention_fn``
(:mod:`jmp_lite.flax.attention`); see :data:`FLAX_HOOKS`.

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
import functools
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite._policy import Policy, get_policy
from jmp_lite.flax import _accumulate as accumulate
from jmp_lite.flax import _attention as attention

_F32 = np.dtype(jnp.float32)

EXPLICIT_DTYPES = ("warn", "keep", "policy")


class ExplicitDtypeWarning(UserWarning):
  """Modules built with an explicit ``dtype=`` compute in it, not in the policy's dtype.

  Issued once per trace by :func:`~jmp_lite.flax.policy_apply`,
  :func:`~jmp_lite.flax.policy_init` and :func:`~jmp_lite.flax.policy_view`
  (with ``explicit_dtypes="warn"``, the default), naming every such module.
  """


def _check_grad_reduction_dtype(value: Any) -> np.dtype | None:
  if value is None:
    return None
  dtype = dtypes.parse_dtype(value)
  if dtype != _F32:
    raise ValueError(
      f"grad_reduction_dtype must be None (the compute dtype) or float32, got {value!r}."
    )
  return dtype


def _check_dtype(value: Any, name: str) -> np.dtype | None:
  if value is None:
    return None
  dtype = dtypes.parse_dtype(value)
  if dtypes.is_float8(dtype):
    raise ValueError(
      f"{name}={dtype.name}: fp8 needs per-tensor scaling, which a module policy does not "
      "provide; use jmp_lite's fp8 matmuls for fp8 compute."
    )
  return dtype


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
    recompute: for an island (a compute dtype other than the enclosing one), run
      the module under :func:`jax.checkpoint`: the backward pass recomputes
      its forward from its inputs instead of keeping its wide intermediates.
      A LayerNorm island otherwise keeps three fp32 copies of its input's size
      (12 bytes per element, as much as in an fp32 model); recomputed, it
      keeps only its 16-bit input (2 bytes), like a fused normalization
      kernel. Only for modules that neither update variables nor draw random
      numbers (normalization without running statistics); costs one more
      forward pass of the module.

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
    if not isinstance(self.recompute, (bool, np.bool_)):
      raise TypeError(f"recompute must be a bool, got {self.recompute!r}.")

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


class Hook(NamedTuple):
  """A Flax attribute jmp_lite replaces when a layer computes in 16 bits.

  ``attribute`` is set to ``replacement`` on modules of class ``cls`` whose
  ``is_default(module)`` holds: a user's own kernel (say, a quantized
  ``dot_general``) is never replaced.
  """

  cls: type
  attribute: str
  is_default: Callable[[Any], bool]
  replacement: Any
  kind: str  # "accumulation" or "softmax": which switch of ModulePolicies enables it


def _default(attribute: str, jax_default: Any) -> Callable[[Any], bool]:
  """Whether a layer still uses Flax's default kernel for ``attribute``.

  Flax spells the default as ``None`` (linen, NNX ``LinearGeneral``) or as
  the JAX function itself (NNX ``Linear``, ``Conv``, ``Einsum``); a
  ``<attribute>_cls`` factory, where the layer has one, also overrides it.
  """

  def is_default(module: Any) -> bool:
    value = getattr(module, attribute, None)
    factory = getattr(module, f"{attribute}_cls", None)
    return factory is None and (value is None or value is jax_default)

  return is_default


_DOT = ("dot_general", lax.dot_general, accumulate.dot_general, "accumulation")
_CONV = (
  "conv_general_dilated",
  lax.conv_general_dilated,
  accumulate.conv_general_dilated,
  "accumulation",
)


def _hook(cls: type, attribute: str, jax_default: Any, replacement: Any, kind: str) -> Hook:
  return Hook(cls, attribute, _default(attribute, jax_default), replacement, kind)


FLAX_HOOKS: tuple[Hook, ...] = (
  _hook(nn.Dense, *_DOT),
  _hook(nn.DenseGeneral, *_DOT),
  _hook(nn.Conv, *_CONV),
  _hook(
    nn.MultiHeadDotProductAttention,
    "attention_fn",
    nn.dot_product_attention,
    attention.dot_product_attention,
    "softmax",
  ),
  _hook(nnx.Linear, *_DOT),
  _hook(nnx.LinearGeneral, *_DOT),
  _hook(nnx.Conv, *_CONV),
  _hook(nnx.Einsum, "einsum_op", jnp.einsum, accumulate.einsum, "accumulation"),
  _hook(
    nnx.MultiHeadAttention,
    "attention_fn",
    nnx.dot_product_attention,
    attention.dot_product_attention,
    "softmax",
  ),
)
"""Flax layers whose default kernels jmp_lite replaces for 16-bit compute.

Not covered (no hook in Flax): linen ``Einsum``, ``ConvTranspose`` and
``Embed.attend``, NNX ``ConvTranspose`` and ``Embed.attend``, and matmuls a
user module writes itself: they run as JAX lowers them (16-bit products, the
same matmuls), without the fp32 output layer or ``grad_reduction_dtype``.
"""


class Resolved(NamedTuple):
  """The effective precision of one module (its class, in its context)."""

  compute_dtype: np.dtype  # inputs and parameters; inherited by submodules without an override
  output_dtype: np.dtype  # outputs of inner calls: the enclosing module's compute dtype
  root_output_dtype: np.dtype  # outputs of the outermost call
  attributes: Mapping[str, Any]  # the user's attributes (explicit overrides only)
  hooks: tuple[Hook, ...]  # Flax kernels to swap in (16-bit compute only)
  recompute: bool  # run under jax.checkpoint (an island that asked for it)
  # The compute dtype the policy alone gives the module (explicit dtypes aside).
  policy_dtype: np.dtype
  # The module's own dtype= where it differs from policy_dtype (None otherwise).
  explicit_dtype: np.dtype | None = None


class ModulePolicies:
  """A policy plus per-module-class overrides, resolved per module.

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
      :mod:`jmp_lite.flax.accumulate`), and an fp32 result for the layer that
      produces the model's fp32 output (the logits before the loss).
    fp32_softmax: give Flax's attention layers :func:`dot_product_attention`
      (an fp32 softmax keeping 16-bit residuals) when they compute in 16 bits.
    grad_reduction_dtype: ``None`` (default) or ``float32``: the dtype in which
      the kernel gradients of 16-bit dense, convolution and einsum layers
      leave their matmuls. ``None`` keeps them in the compute dtype, as Flax's
      16-bit layers do, so that under data parallelism or FSDP the
      cross-device reduction of the per-device partial gradients moves 16-bit
      values; ``float32`` reduces in fp32 (twice the bytes) and rounds the sum
      once to the compute dtype.
    explicit_dtypes: what happens to a module whose own ``dtype`` attribute
      (``nn.Dense(..., dtype=jnp.float32)``) differs from the compute dtype the
      policy gives it. ``"warn"`` (default): it keeps its dtype, as an island
      (inputs and its parameters in that dtype; modules inside it without an
      override inherit it), and an :class:`ExplicitDtypeWarning` names it.
      ``"keep"``: the same, silently (the dtypes are deliberate). ``"policy"``:
      its ``dtype`` is set to the policy's compute dtype while it runs. A
      ``ModulePolicy`` whose ``attributes`` set ``dtype`` decides for its class.

  Raises:
    TypeError: for an override key that is not a Flax module class, or a value
      that is not a ModulePolicy, dtype or None.
    ValueError: for an fp8 compute dtype (use jmp_lite's fp8 support), an
      unknown dtype name, an ``explicit_dtypes`` not in ``"warn"``, ``"keep"``,
      ``"policy"``, or a ``grad_reduction_dtype`` other than fp32 (or with
      ``fp32_accumulation=False``).
  """

  def __init__(
    self,
    policy: Policy | str,
    overrides: Mapping[type, ModulePolicy | dtypes.DTypeLike | None] | None = None,
    *,
    use_default_overrides: bool = True,
    fp32_accumulation: bool = True,
    fp32_softmax: bool = True,
    grad_reduction_dtype: dtypes.DTypeLike | None = None,
    explicit_dtypes: str = "warn",
  ):
    self.policy = get_policy(policy)
    self.grad_reduction_dtype = _check_grad_reduction_dtype(grad_reduction_dtype)
    if explicit_dtypes not in EXPLICIT_DTYPES:
      raise ValueError(
        f"explicit_dtypes must be one of {', '.join(map(repr, EXPLICIT_DTYPES))}; got "
        f"{explicit_dtypes!r}."
      )
    self.explicit_dtypes = explicit_dtypes
    if dtypes.is_float8(self.policy.compute_dtype):
      raise ValueError(
        f"Policy {self.policy} computes in fp8, which needs per-tensor scaling that casting "
        "Flax modules cannot provide; use jmp_lite's fp8 matmuls for fp8 compute."
      )
    if overrides is not None and not isinstance(overrides, Mapping):
      raise TypeError(
        f"overrides must be a mapping from module class to ModulePolicy, got {overrides!r}."
      )
    table: dict[type, ModulePolicy | None] = (
      dict(DEFAULT_OVERRIDES) if use_default_overrides else {}
    )
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
    self.overrides: Mapping[type, ModulePolicy | None] = types.MappingProxyType(table)
    self.fp32_accumulation = bool(fp32_accumulation)
    if self.grad_reduction_dtype is not None and not self.fp32_accumulation:
      raise ValueError(
        "grad_reduction_dtype needs jmp_lite's kernels, which fp32_accumulation=False switches "
        "off; keep fp32_accumulation=True or drop grad_reduction_dtype."
      )
    self.fp32_softmax = bool(fp32_softmax)
    self._cache: dict[tuple, Resolved] = {}

  def _key(self):
    return (
      self.policy,
      tuple(
        sorted(
          (((c.__module__, c.__qualname__, id(c)), p) for c, p in self.overrides.items()),
          key=lambda item: item[0],
        )
      ),
      self.fp32_accumulation,
      self.fp32_softmax,
      self.grad_reduction_dtype,
      self.explicit_dtypes,
    )

  def __eq__(self, other):
    return isinstance(other, ModulePolicies) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in self.overrides)
    return f"ModulePolicies({self.policy}, overrides=[{names}])"

  def module_policy(self, cls: type) -> ModulePolicy | None:
    """The override for ``cls``: that of its most specific class in the table.

    ``None`` if there is none, or the closest entry is an explicit ``None``.
    """
    for base in cls.__mro__:
      if base in self.overrides:
        return self.overrides[base]
    return None

  def resolve(
    self, cls: type, parent: Resolved | None = None, dtype: np.dtype | None = None
  ) -> Resolved:
    """The precision of a module of class ``cls`` called inside ``parent``.

    ``parent`` is the :class:`Resolved` of the enclosing module, ``None`` at
    the top (then the policy's compute dtype is the context). ``dtype`` is the
    module's own ``dtype`` attribute (:func:`explicit_dtype`), if any.
    """
    context = parent.compute_dtype if parent is not None else self.policy.compute_dtype
    policy_context = parent.policy_dtype if parent is not None else self.policy.compute_dtype
    key = (cls, context, policy_context, dtype)
    if key not in self._cache:
      override = self.module_policy(cls)
      attributes: Mapping[str, Any] = (
        override.attributes if override else types.MappingProxyType({})
      )
      # What the policy alone asks for; the warning compares the module's dtype with it.
      if override is None:
        policy_dtype = policy_context
      else:
        policy_dtype = override.compute_dtype or self.policy.compute_dtype
      explicit = None
      if dtype is not None and dtype != policy_dtype and "dtype" not in attributes:
        explicit = dtype
      output = override.output_dtype if override else None
      if explicit is not None and self.explicit_dtypes != "policy":
        # The module computes in its own dtype whatever is cast: make it an island of
        # that dtype, so that its parameters are read unrounded and its inputs arrive
        # in the dtype it computes in.
        compute = explicit
      elif override is None:  # inherit the context
        compute = context
      else:
        compute = policy_dtype
      root_output = output or self.policy.output_dtype
      recompute = bool(override and override.recompute) and compute != context
      hooks: tuple[Hook, ...] = ()
      if accumulate.is_16bit_float(compute):
        enabled = {"accumulation": self.fp32_accumulation, "softmax": self.fp32_softmax}
        hooks = tuple(
          h
          for h in FLAX_HOOKS
          if issubclass(cls, h.cls) and enabled[h.kind] and h.attribute not in attributes
        )
      self._cache[key] = Resolved(
        compute,
        output or context,
        root_output,
        attributes,
        hooks,
        recompute,
        policy_dtype,
        explicit,
      )
    return self._cache[key]

  def attribute_updates(
    self, module: Any, resolved: Resolved | None = None, *, wide_output: bool = False
  ) -> dict[str, Any]:
    """Attributes to set on ``module`` while it runs (hooks, then the user's).

    ``resolved`` is the module's :class:`Resolved` (default: at the top).
    ``wide_output``: the module's output is the model's output, in the
    policy's output dtype; its matmul then produces that dtype directly.
    """
    resolved = resolved or self.resolve(type(module), None, explicit_dtype(module))
    options: dict[str, Any] = {}
    if self.grad_reduction_dtype is not None:
      options["rhs_grad_dtype"] = self.grad_reduction_dtype
    if wide_output and np.dtype(resolved.root_output_dtype) == _F32:
      options["output_dtype"] = _F32
    updates = {
      h.attribute: (
        functools.partial(h.replacement, **options)
        if options and h.kind == "accumulation"
        else h.replacement
      )
      for h in resolved.hooks
      # (a layer already given jmp_lite's kernel, e.g. by policy_view, may get its options)
      if h.is_default(module) or _unwrapped(getattr(module, h.attribute, None)) is h.replacement
    }
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


def explicit_dtype(module: Any) -> np.dtype | None:
  """The floating dtype a module was built with (its ``dtype`` attribute), or None.

  Read from the instance's ``__dict__``: a linen module's ``__getattr__``
  would run its ``setup`` for a missing name.
  """
  value = getattr(module, "__dict__", {}).get("dtype")
  if value is None:
    return None
  try:
    dtype = np.dtype(value)
  except (TypeError, ValueError):  # some other meaning of "dtype"
    return None
  return dtype if jnp.issubdtype(dtype, jnp.floating) else None


def warn_explicit_dtypes(
  found: Mapping[str, tuple[str, np.dtype, np.dtype]], caller: str, stacklevel: int
) -> None:
  """Issues one :class:`ExplicitDtypeWarning` naming every module in ``found``.

  Args:
    found: ``{path: (class name, the module's dtype, the policy's dtype)}``.
    caller: the public function the user called, for the message.
    stacklevel: as for :func:`warnings.warn`, counted from the caller of this function.
  """
  if not found:
    return
  names = "; ".join(
    f"{path or '(the model)'} ({cls}: dtype={dtype.name}, policy: {np.dtype(policy).name})"
    for path, (cls, dtype, policy) in found.items()
  )
  warnings.warn(
    f"{caller}: {len(found)} module(s) were built with an explicit dtype= other than the "
    f"compute dtype the policy gives them, and compute in their own dtype (so do the "
    f"modules inside them without a dtype of their own): {names}. To train in the policy's "
    "dtype, drop dtype= from these modules (Flax's default dtype=None follows the policy) "
    "or pass explicit_dtypes='policy'; if the dtypes are deliberate, pass "
    "explicit_dtypes='keep' to silence this warning.",
    ExplicitDtypeWarning,
    stacklevel=stacklevel + 1,
  )


def cast_floating(tree: Any, dtype: np.dtype) -> Any:
  """Casts the floating-point array leaves of ``tree`` to ``dtype``.

  Unlike :meth:`Policy.cast_to_compute`, tracers of any JAX transformation and
  Python floats are left to JAX's promotion rules (Python scalars stay weakly
  typed); integer, boolean and key arrays pass through.
  """

  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
      return x if x.dtype == dtype else x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


def recomputed(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """``fn(*args, **kwargs)`` under :func:`jax.checkpoint` (non-array arguments static)."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

  def call(*arrays):
    it = iter(arrays)
    full = [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
    a, k = jax.tree_util.tree_unflatten(treedef, full)
    return fn(*a, **k)

  return jax.checkpoint(call)(*(x for x, a in zip(leaves, is_array, strict=True) if a))


class CallRecord(NamedTuple):
  """One module call seen while tracing a model to find its output layers."""

  path: tuple
  raw: list  # the array leaves the module computed
  returned: list  # the array leaves it returned (after its output cast)


def record_call(path: tuple, raw: Any, returned: Any) -> CallRecord:
  arrays = lambda tree: [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]
  return CallRecord(tuple(path), arrays(raw), arrays(returned))


def output_chain(records: list[CallRecord]) -> frozenset[tuple]:
  """The modules whose output is (part of) the model's output, from the calls of one trace.

  ``records`` are in exit order, the outermost call last. Matched by
  identity, from the outermost call down: a module is in the chain if what it
  returned is part of the raw output of one already in it (the outermost call
  is), so the chain from the model down to the layer that computes its output
  is found. A module whose result is transformed before it is returned
  (``.astype``, a division, a lifted transform) ends the chain. The records
  hold the arrays, so their ids are not reused while this runs.
  """
  found: set[tuple] = set()
  wanted: set[int] = set()
  for i, (path, raw, returned) in enumerate(reversed(records)):
    if i == 0 or wanted & {id(x) for x in returned}:
      found.add(path)
      wanted |= {id(x) for x in raw}
  return frozenset(found)


def _unwrapped(fn: Any) -> Any:
  """``fn``, or the function a ``functools.partial`` of jmp_lite's options wraps."""
  return fn.func if isinstance(fn, functools.partial) else fn


def nearest(path: tuple, table: Mapping[tuple, Any]) -> Any:
  """The entry of ``table`` at ``path`` or at its closest ancestor (None if none)."""
  for n in range(len(path), -1, -1):
    if path[:n] in table:
      return table[path[:n]]
  return None
