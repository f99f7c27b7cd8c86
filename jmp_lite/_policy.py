"""Precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is three dtypes and three pure casting functions. Typical use
keeps fp32 master parameters, casts a working copy to 16 bits for the forward
and backward pass, and returns outputs (e.g. logits fed to the loss) in fp32::

  policy = get_policy("params=float32,compute=bfloat16,output=float32")
  logits = model.apply(policy.cast_to_compute(params), policy.cast_to_compute(x))
  loss = cross_entropy(policy.cast_to_output(logits), labels)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes

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


def _cast_floating_to(tree: T, dtype: dtypes.DTypeLike) -> T:
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

  Each dtype may be given as a name accepted by :func:`jmp_lite.dtypes.parse_dtype`
  or any dtype-like object; as in jmp it is stored as the JAX scalar type
  (``jnp.float32``, ``jnp.bfloat16``, ``jnp.float8_e4m3fn``...; see
  :func:`jmp_lite.dtypes.scalar_type`): callable (``policy.compute_dtype(1.0)``
  is an array), a dict key next to ``jnp.float16``, equal to the ``np.dtype``,
  and ``jnp.dtype(policy.compute_dtype)`` is that ``np.dtype``. fp8 formats are
  accepted for ``compute_dtype`` only: parameters and outputs in 8 bits would
  lose the training signal.

  Only floating-point array leaves (``jax.Array`` or ``np.ndarray``) are cast;
  integer arrays, Python scalars and other leaves pass through unchanged.

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
    """Casts the floating-point leaves of ``x`` to the param dtype."""
    return _cast_floating_to(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating-point leaves of ``x`` to the compute dtype."""
    return _cast_floating_to(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating-point leaves of ``x`` to the output dtype."""
    return _cast_floating_to(x, self.output_dtype)

  def with_output_dtype(self, output_dtype: dtypes.DTypeLike) -> Policy:
    """Returns a copy of this policy with another output dtype."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    return "p={},c={},o={}".format(
      *map(dtypes.dtype_name, (self.param_dtype, self.compute_dtype, self.output_dtype))
    )


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
  ``str(policy)`` gives a string that parses back to an equal policy.

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
  text = policy_name.strip().lower()
  if not text:
    raise ValueError(
      "Empty policy string; expected e.g. 'p=f32,c=bf16,o=f32', 'half', or 'mixed_bfloat16'."
    )
  if text in _KERAS_POLICIES:
    return Policy(*_KERAS_POLICIES[text])
  if "=" not in text:
    return Policy(text, text, text)

  given = {}
  for part in text.split(","):
    key, sep, value = (s.strip() for s in part.partition("="))
    if not sep or not key or not value:
      raise ValueError(
        f"Malformed part {part.strip()!r} in policy {policy_name!r}: "
        "expected key=value with key params/p, compute/c or output/o."
      )
    if key not in _KEYS:
      raise ValueError(
        f"Unknown key {key!r} in policy {policy_name!r}; expected params/p, compute/c or output/o."
      )
    if _KEYS[key] in given:
      raise ValueError(f"Key {_KEYS[key]!r} given twice in policy {policy_name!r}.")
    try:
      given[_KEYS[key]] = dtypes.parse_dtype(value)
    except (TypeError, ValueError) as e:
      raise type(e)(f"In policy {policy_name!r}: {e}") from e
  params = given.get("params", np.dtype(jnp.float32))
  compute = given.get("compute", params)
  output = given.get("output", params if dtypes.is_float8(compute) else compute)
  return Policy(params, compute, output)


def cast_to_full(tree: T) -> T:
  """Casts the floating-point leaves of ``tree`` to float32.

  >>> cast_to_full({"h": jnp.ones(2, jnp.float16), "n": jnp.arange(2)})["h"].dtype.name
  'float32'
  """
  return _cast_floating_to(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
  """Casts the floating-point leaves of ``tree`` to :func:`half_dtype`."""
  return _cast_floating_to(tree, dtypes.half_dtype())
