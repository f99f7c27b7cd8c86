"""Precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is three dtypes and three pure casting functions. Typical use
keeps fp32 master parameters, casts a working copy to 16 bits for the forward
and backward pass, and returns outputs (e.g. logits fed to the loss) in fp32::

  policy = get_policy("params=float32,compute=bfloat16,output=float32")
  logits = model.apply(policy.cast_to_compute(params), policy.cast_to_compute(x))
  loss = cross_entropy(policy.cast_to_output(logits), labels)

An :class:`Fp8Policy` adds fp8 matmuls to a policy. Both are spelled in one
grammar, a comma-separated list of ``key=value`` parts (``params``/``p``,
``compute``/``c``, ``output``/``o``, and ``fp8`` for :func:`get_fp8_policy`)
or a single dtype or Keras policy name; one parser reads it for
:func:`get_policy` and :func:`get_fp8_policy`, with one style of error.

Imports flow ``_dtypes`` -> ``_fp8_config`` -> here -> ... -> ``fp8``: the
fp8 recipe is an :class:`~jmp_lite.fp8.Fp8Config`, which needs nothing of the
fp8 implementation.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite._fp8_config import E4M3, E5M2, Fp8Config, as_config, as_fp8_dtype

T = TypeVar("T")

# Keras' global mixed precision policies: fp32 variables, 16-bit compute, and
# (as in Keras) layer outputs in the compute dtype.
_KERAS_POLICIES = {
  "mixed_bfloat16": ("f32", "bf16", "bf16"),
  "mixed_float16": ("f32", "f16", "f16"),
}
_KEYS = {
  "p": "params",
  "params": "params",
  "c": "compute",
  "compute": "compute",
  "o": "output",
  "output": "output",
}
_FP8_KEY = "fp8"
# fp8 recipes by name: (forward format, backward format).
_RECIPES = {
  "hybrid": (E4M3, E5M2),
  "e4m3": (E4M3, E4M3),
  "e5m2": (E5M2, E5M2),
}


def cast_floating(tree: T, dtype: dtypes.DTypeLike) -> T:
  """Casts the floating-point array leaves of ``tree`` to ``dtype``.

  The rule every policy cast follows: only ``jax.Array`` leaves (tracers
  included) and ``np.ndarray`` leaves of a floating dtype are cast; integer,
  boolean and key arrays, Python scalars (which stay weakly typed) and other
  leaves pass through, and a leaf already in ``dtype`` is returned as it is.

  Args:
    tree: any pytree.
    dtype: the target floating dtype (a dtype or a JAX scalar type).

  Returns:
    ``tree`` with its floating array leaves in ``dtype``.
  """
  dtype = np.dtype(dtype)  # a scalar type such as jnp.bfloat16 -> its np.dtype

  def cast(x):
    if (
      isinstance(x, (np.ndarray, jax.Array))
      and jnp.issubdtype(x.dtype, jnp.floating)
      and x.dtype != dtype
    ):
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtypes for parameters, computation and outputs (hashable, jit-static).

  Each dtype may be given as a name accepted by :func:`jmp_lite.parse_dtype`
  or any dtype-like object; as in jmp it is stored as the JAX scalar type
  (``jnp.float32``, ``jnp.bfloat16``, ``jnp.float8_e4m3fn``...; see
  :func:`jmp_lite.scalar_type`): callable (``policy.compute_dtype(1.0)``
  is an array), a dict key next to ``jnp.float16``, equal to the ``np.dtype``,
  and ``jnp.dtype(policy.compute_dtype)`` is that ``np.dtype``. fp8 formats are
  accepted for ``compute_dtype`` only: parameters and outputs in 8 bits would
  lose the training signal.

  Only floating-point array leaves (``jax.Array`` or ``np.ndarray``) are cast;
  integer arrays, Python scalars and other leaves pass through unchanged.

  Attributes:
    param_dtype: the dtype parameters are stored and updated in.
    compute_dtype: the dtype of the forward and backward computation.
    output_dtype: the dtype of the outputs (e.g. the logits fed to the loss).

  >>> policy = Policy("float32", "bfloat16", "float32")
  >>> params = {"w": jnp.ones((2, 2)), "step": jnp.array(3)}
  >>> jax.tree.map(lambda x: x.dtype.name, policy.cast_to_compute(params))
  {'step': 'int32', 'w': 'bfloat16'}
  >>> policy.cast_to_output(jnp.ones(2, jnp.bfloat16)).dtype.name
  'float32'
  >>> policy.compute_dtype is jnp.bfloat16, policy.compute_dtype(2.0).dtype.name
  (True, 'bfloat16')
  """

  param_dtype: dtypes.ScalarType
  compute_dtype: dtypes.ScalarType
  output_dtype: dtypes.ScalarType

  if TYPE_CHECKING:  # The dataclass __init__ accepts names too; __post_init__ parses them.

    def __init__(
      self,
      param_dtype: dtypes.DTypeLike,
      compute_dtype: dtypes.DTypeLike,
      output_dtype: dtypes.DTypeLike,
    ) -> None: ...

  def __post_init__(self):
    for field in dataclasses.fields(self):
      dtype = dtypes.parse_dtype(getattr(self, field.name))
      if field.name != "compute_dtype" and dtypes.is_float8(dtype):
        raise ValueError(
          f"{field.name}={dtype.name} is not supported: fp8 is accepted for the "
          "compute dtype only; keep parameters and outputs in 16 or 32 bits."
        )
      object.__setattr__(self, field.name, dtypes.scalar_type(dtype))

  def cast_to_param(self, x: T) -> T:
    """Casts the floating-point leaves of ``x`` to the param dtype.

    Args:
      x: any pytree, e.g. parameters restored from a checkpoint.

    Returns:
      ``x`` with its floating array leaves in :attr:`param_dtype`.
    """
    return cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating-point leaves of ``x`` to the compute dtype.

    The working copy of the parameters and the inputs of the forward pass
    (whose backward pass then runs in this dtype too).

    Args:
      x: any pytree.

    Returns:
      ``x`` with its floating array leaves in :attr:`compute_dtype`.
    """
    return cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating-point leaves of ``x`` to the output dtype.

    Args:
      x: any pytree, e.g. the logits, before the loss.

    Returns:
      ``x`` with its floating array leaves in :attr:`output_dtype`.
    """
    return cast_floating(x, self.output_dtype)

  def with_output_dtype(self, output_dtype: dtypes.DTypeLike) -> Policy:
    """Returns a copy of this policy with another output dtype.

    Args:
      output_dtype: the new output dtype (a name or dtype-like object).

    Returns:
      A :class:`Policy` with this one's param and compute dtypes.
    """
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    return "p={},c={},o={}".format(
      *map(dtypes.dtype_name, (self.param_dtype, self.compute_dtype, self.output_dtype))
    )


@dataclasses.dataclass(frozen=True)
class Fp8Policy:
  """A precision policy plus fp8 matmuls (hashable, jit-static).

  ``str(p)`` spells it back, e.g. ``"p=f32,c=bf16,o=f32,fp8=hybrid"``; only the
  formats are spelled, the history length, algorithm and margin are not.

  Attributes:
    policy: the dtypes of everything that is not an fp8 matmul (its compute
      dtype is never fp8).
    config: the fp8 recipe for matmuls (an :class:`~jmp_lite.fp8.Fp8Config`),
      or ``None`` for no fp8.

  >>> str(Fp8Policy(get_policy("p=f32,c=bf16,o=f32"), Fp8Config()))
  'p=f32,c=bf16,o=f32,fp8=hybrid'
  """

  policy: Policy
  config: Fp8Config | None = None

  def __post_init__(self):
    if not isinstance(self.policy, Policy):
      raise TypeError(f"policy must be a jmp_lite Policy, got {type(self.policy).__name__}.")
    if dtypes.is_float8(self.policy.compute_dtype):
      raise ValueError(
        f"Fp8Policy.policy has compute dtype {np.dtype(self.policy.compute_dtype).name}; use a "
        "16/32-bit compute dtype for non-matmul ops and put the fp8 recipe in config."
      )
    if self.config is not None:
      as_config(self.config)

  def __str__(self) -> str:
    if self.config is None:
      return str(self.policy)
    return f"{self.policy},fp8={_recipe_name(self.config)}"


# -----------------------------------------------------------------------------
# The grammar


class _Parsed(NamedTuple):
  name: str | None  # a dtype or Keras policy name standing for the whole policy
  values: dict[str, str]  # canonical key -> value, as written (lower case)


def _parse(spec: str, *, fp8: bool) -> _Parsed:
  """Splits a policy string into its parts and checks their keys (not their values).

  A part is ``key=value``; a part without ``=`` is a dtype or Keras policy
  name, allowed when it is the only part besides ``fp8=``.
  """
  text = spec.strip().lower()
  if not text:
    raise ValueError(
      "Empty policy string; expected e.g. 'p=f32,c=bf16,o=f32', 'half', or 'mixed_bfloat16'."
    )
  keys = {**_KEYS, _FP8_KEY: _FP8_KEY} if fp8 else _KEYS
  expected = "params/p, compute/c, output/o or fp8" if fp8 else "params/p, compute/c or output/o"
  parts = [part.strip() for part in text.split(",")]
  # The parts besides `fp8=...`: a bare `fp8` is a part like any other (and then malformed).
  named_parts = sum(
    not (sep and key.strip() == _FP8_KEY) for key, sep, _ in (p.partition("=") for p in parts)
  )
  name, values = None, {}
  for part in parts:
    key, sep, value = (s.strip() for s in part.partition("="))
    if not sep and key and named_parts == 1:
      name = key
      continue
    if not sep or not key or not value:
      raise ValueError(
        f"Malformed part {part!r} in policy {spec!r}: expected key=value with key {expected}."
      )
    if key not in keys:
      hint = " (fp8= is read by get_fp8_policy)" if key == _FP8_KEY else ""
      raise ValueError(f"Unknown key {key!r} in policy {spec!r}; expected {expected}{hint}.")
    if keys[key] in values:
      raise ValueError(f"Key {keys[key]!r} given twice in policy {spec!r}.")
    values[keys[key]] = value
  return _Parsed(name, values)


def _policy_of(parsed: _Parsed, spec: str) -> Policy:
  """The :class:`Policy` of the ``params``/``compute``/``output`` parts (or of the name)."""
  if parsed.name is not None:
    if parsed.name in _KERAS_POLICIES:
      return Policy(*_KERAS_POLICIES[parsed.name])
    return Policy(parsed.name, parsed.name, parsed.name)
  given = {}
  for key in ("params", "compute", "output"):
    if key in parsed.values:
      try:
        given[key] = dtypes.parse_dtype(parsed.values[key])
      except (TypeError, ValueError) as e:
        raise type(e)(f"In policy {spec!r}: {e}") from e
  params = given.get("params", np.dtype(jnp.float32))
  compute = given.get("compute", params)
  output = given.get("output", params if dtypes.is_float8(compute) else compute)
  return Policy(params, compute, output)


def _recipe_of(value: str, spec: str) -> tuple[np.dtype, np.dtype] | None:
  """(forward, backward) fp8 formats of an ``fp8=`` value; ``None`` for no fp8."""
  if value in ("none", "off"):
    return None
  if value in _RECIPES:
    return _RECIPES[value]
  fwd, sep, bwd = value.partition("/")
  if sep:
    try:
      return (as_fp8_dtype(fwd.strip(), "fp8 forward format"),
              as_fp8_dtype(bwd.strip(), "fp8 backward format"))  # fmt: skip
    except (TypeError, ValueError) as e:
      raise ValueError(f"In policy {spec!r}: {e}") from e
  raise ValueError(
    f"Unknown fp8 recipe {value!r} in policy {spec!r}; expected hybrid (e4m3 forward, e5m2 "
    "backward), e4m3, e5m2, none, or forward/backward formats such as f8e4m3/f8e5m2."
  )


def _recipe_name(config: Fp8Config) -> str:
  for name, formats in _RECIPES.items():
    if formats == (config.fwd_dtype, config.bwd_dtype):
      return name
  return f"{dtypes.dtype_name(config.fwd_dtype)}/{dtypes.dtype_name(config.bwd_dtype)}"


# -----------------------------------------------------------------------------
# Entry points


def get_policy(policy_name: str | Policy) -> Policy:
  """Parses a policy string (jmp's grammar, plus Keras' policy names).

  Accepted forms:

  * ``"params=float32,compute=bfloat16,output=float32"`` or the short keys
    ``"p=f32,c=bf16,o=f32"``, in any order, each key at most once. Defaults:
    params float32, compute follows params, output follows compute, so
    ``"c=f16"`` means ``p=f32,c=f16,o=f16`` (an fp8 compute dtype leaves the
    output in the param dtype).
  * a single dtype name for all three, e.g. ``"half"``, ``"full"``, ``"bf16"``.
  * ``"mixed_bfloat16"`` / ``"mixed_float16"``: Keras' policies,
    ``p=f32,c=bf16,o=bf16`` / ``p=f32,c=f16,o=f16``.

  Whitespace around keys, values and commas is ignored, and so is case.
  ``str(policy)`` gives a string that parses back to an equal policy. The
  ``fp8=`` key of the same grammar is read by :func:`get_fp8_policy`.

  Args:
    policy_name: the policy string, or a :class:`Policy` (returned as is).

  Returns:
    The :class:`Policy`.

  Raises:
    ValueError: for an empty string, an unknown or repeated key, a part that is
      not ``key=value``, or an unknown dtype name.
    TypeError: for a non-string argument or a non-floating dtype.

  >>> policy = get_policy("params=float32, compute=float16, output=float32")
  >>> policy.compute_dtype is jnp.float16, str(policy)
  (True, 'p=f32,c=f16,o=f32')
  >>> str(get_policy("c=bf16")), str(get_policy("mixed_float16"))
  ('p=f32,c=bf16,o=bf16', 'p=f32,c=f16,o=f16')
  >>> get_policy("p=f32,c=bf16,o=f32") == get_policy("p=f32,c=bf16,o=f32")  # hashable, jit-static
  True
  """
  if isinstance(policy_name, Policy):
    return policy_name
  if not isinstance(policy_name, str):
    raise TypeError(
      f"get_policy expects a string such as 'p=f32,c=bf16,o=f32', got "
      f"{policy_name!r} of type {type(policy_name).__name__}."
    )
  return _policy_of(_parse(policy_name, fp8=False), policy_name)


def get_fp8_policy(spec: str | Policy | Fp8Policy, **config_kwargs: Any) -> Fp8Policy:
  """Parses a policy with fp8 matmuls.

  Two spellings:

  * :func:`get_policy`'s grammar plus an ``fp8=`` key:
    ``"p=f32,c=bf16,o=f32,fp8=hybrid"`` runs Dense/DenseGeneral/Einsum
    matmuls in fp8 (E4M3 forward, E5M2 backward) and everything else as
    ``p=f32,c=bf16,o=f32``. Recipes: ``hybrid``, ``e4m3``, ``e5m2``,
    ``none``, or ``<fwd>/<bwd>`` dtype names. ``"fp8=hybrid"`` alone keeps
    everything else in float32.
  * an fp8 compute dtype, which :func:`get_policy` already accepts:
    ``"p=f32,c=f8e4m3"`` means fp8 matmuls with that forward format (E5M2
    backward for E4M3) and everything else in the param dtype.

  Args:
    spec: the string, a :class:`Policy`, or an :class:`Fp8Policy` (returned
      as is when no ``config_kwargs`` are given).
    **config_kwargs: further :class:`~jmp_lite.fp8.Fp8Config` fields
      (``amax_history_length``, ``amax_compute_algo``, ``margin``,
      ``fast_accumulation``).

  Returns:
    The :class:`Fp8Policy`; its ``config`` is ``None`` when ``spec`` asks for
    no fp8.

  Raises:
    ValueError: for what :func:`get_policy` rejects, an unknown recipe, both
      an fp8 compute dtype and an ``fp8=`` recipe, or ``config_kwargs`` for a
      policy without fp8.
    TypeError: for an argument that is not a string or policy.

  >>> str(get_fp8_policy("params=float32, compute=bfloat16, output=float32, fp8=hybrid"))
  'p=f32,c=bf16,o=f32,fp8=hybrid'
  >>> str(get_fp8_policy("p=f32,c=f8e4m3"))
  'p=f32,c=f32,o=f32,fp8=hybrid'
  """
  if isinstance(spec, Fp8Policy):
    if not config_kwargs:
      return spec
    if spec.config is None:
      raise ValueError(f"fp8 options {sorted(config_kwargs)} given for a policy without fp8.")
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, **config_kwargs))
  recipe: tuple[np.dtype, np.dtype] | None = None
  if isinstance(spec, Policy):
    base = spec
  elif isinstance(spec, str):
    parsed = _parse(spec, fp8=True)
    if _FP8_KEY in parsed.values:
      recipe = _recipe_of(parsed.values[_FP8_KEY], spec)
    base = _policy_of(parsed, spec)
  else:
    raise TypeError(
      "get_fp8_policy expects a string such as 'p=f32,c=bf16,o=f32,fp8=hybrid', a Policy or an "
      f"Fp8Policy, got {spec!r} of type {type(spec).__name__}."
    )
  if dtypes.is_float8(base.compute_dtype):
    if recipe is not None:
      raise ValueError(
        f"Policy {spec!r} gives both an fp8 compute dtype and an fp8= recipe; use one of them."
      )
    recipe = (as_fp8_dtype(base.compute_dtype, "compute dtype"), E5M2)
    base = Policy(base.param_dtype, base.param_dtype, base.output_dtype)
  if recipe is None:
    if config_kwargs:
      raise ValueError(f"fp8 options {sorted(config_kwargs)} given for a policy without fp8.")
    return Fp8Policy(base, None)
  return Fp8Policy(base, Fp8Config(recipe[0], recipe[1], **config_kwargs))


def cast_to_full(tree: T) -> T:
  """Casts the floating-point leaves of ``tree`` to float32.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with its floating array leaves in float32.

  >>> cast_to_full({"h": jnp.ones(2, jnp.float16), "n": jnp.arange(2)})["h"].dtype.name
  'float32'
  """
  return cast_floating(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
  """Casts the floating-point leaves of ``tree`` to :func:`~jmp_lite.half_dtype`.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with its floating array leaves in the platform's half dtype
    (bfloat16, or float16 on GPUs without native bfloat16).
  """
  return cast_floating(tree, dtypes.half_dtype())
