"""Precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is three dtypes and three pure casting functions. Typical use
keeps fp32 master parameters, casts a working copy to 16 bits for the forward
and backward pass, and returns outputs (e.g. logits fed to the loss) in fp32::

  policy = get_policy("params=float32,compute=bfloat16,output=float32")
  logits = model.apply(policy.cast_to_compute(params), policy.cast_to_compute(x))
  loss = cross_entropy(policy.cast_to_output(logits), labels)

An :class:`~jmp_lite.fp8.Fp8Policy` adds fp8 matmuls to a policy. Both are
spelled in one grammar, a comma-separated list of ``key=value`` parts
(``params``/``p``, ``compute``/``c``, ``output``/``o``, and ``fp8`` for
:func:`~jmp_lite.fp8.get_fp8_policy`) or a single dtype or Keras policy name;
one parser (:func:`parse_spec`) reads it for :func:`get_policy` and
:func:`~jmp_lite.fp8.get_fp8_policy`, with one style of error.

Imports flow ``_dtypes`` -> here -> ... -> ``fp8``: the fp8 policy holds an fp8
recipe, which carries its matmul, so it lives in the fp8 package and reads the
``fp8=`` value there; this module parses the parts and the dtype keys.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation

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
FP8_KEY = "fp8"


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


# -----------------------------------------------------------------------------
# The grammar


class Parsed(NamedTuple):
  """A policy string split into its parts."""

  name: str | None  # a dtype or Keras policy name standing for the whole policy
  values: dict[str, str]  # canonical key -> value, as written (lower case)


def parse_spec(spec: str, *, fp8: bool) -> Parsed:
  """Splits a policy string into its parts and checks their keys (not their values).

  A part is ``key=value``; a part without ``=`` is a dtype or Keras policy
  name, allowed when it is the only part besides ``fp8=``.

  Args:
    spec: the policy string.
    fp8: whether the ``fp8`` key is accepted (:func:`~jmp_lite.fp8.get_fp8_policy`).

  Returns:
    The :class:`Parsed` parts, values lower case.

  Raises:
    ValueError: naming the part, for an empty string, a malformed part, or an
      unknown or repeated key.
  """
  text = spec.strip().lower()
  if not text:
    raise ValueError(
      "Empty policy string; expected e.g. 'p=f32,c=bf16,o=f32', 'half', or 'mixed_bfloat16'."
    )
  keys = {**_KEYS, FP8_KEY: FP8_KEY} if fp8 else _KEYS
  expected = "params/p, compute/c, output/o or fp8" if fp8 else "params/p, compute/c or output/o"
  parts = [part.strip() for part in text.split(",")]
  # The parts besides `fp8=...`: a bare `fp8` is a part like any other (and then malformed).
  named_parts = sum(
    not (sep and key.strip() == FP8_KEY) for key, sep, _ in (p.partition("=") for p in parts)
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
      hint = " (fp8= is read by get_fp8_policy)" if key == FP8_KEY else ""
      raise ValueError(f"Unknown key {key!r} in policy {spec!r}; expected {expected}{hint}.")
    if keys[key] in values:
      raise ValueError(f"Key {keys[key]!r} given twice in policy {spec!r}.")
    values[keys[key]] = value
  return Parsed(name, values)


def policy_of(parsed: Parsed, spec: str) -> Policy:
  """The :class:`Policy` of the ``params``/``compute``/``output`` parts (or of the name).

  Args:
    parsed: what :func:`parse_spec` read.
    spec: the policy string, for the error messages.

  Returns:
    The :class:`Policy`.
  """
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
  ``fp8=`` key of the same grammar is read by :func:`~jmp_lite.fp8.get_fp8_policy`.

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
  _validation.check_type(
    policy_name, str, "get_policy expects a string such as 'p=f32,c=bf16,o=f32'"
  )
  return policy_of(parse_spec(policy_name, fp8=False), policy_name)


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
