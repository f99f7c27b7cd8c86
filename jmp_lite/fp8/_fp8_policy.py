"""fp8 policies: a precision policy plus the fp8 recipe of its matmuls (private).

The string is :func:`jmp_lite.get_policy`'s grammar (read by the same parser,
``jmp_lite._policy.parse_spec``) with one more key, ``fp8=``, whose value is

.. code-block:: text

  none | off | RECIPE | FORMATS | RECIPE:FORMATS
  RECIPE  = current | delayed | rowwise | block | mxfp8
  FORMATS = hybrid | e4m3 | e5m2 | FORWARD/BACKWARD    (e.g. f8e4m3/f8e5m2)

A recipe alone has its own default formats; formats alone are those of the
default recipe, :class:`CurrentScaling`. The policy lives here, above the
recipes, because a recipe carries its matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite._fp8_config import E4M3, E5M2, as_fp8_dtype
from jmp_lite._policy import FP8_KEY, Policy, parse_spec, policy_of
from jmp_lite.fp8 import _recipes as recipes

Formats = tuple[np.dtype, np.dtype]  # (forward, backward)
# The format spellings: (forward format, backward format).
_FORMATS: dict[str, Formats] = {
  "hybrid": (E4M3, E5M2),
  "e4m3": (E4M3, E4M3),
  "e5m2": (E5M2, E5M2),
}


def _paired(recipe: Any) -> Formats:
  return (recipe.fwd_dtype, recipe.bwd_dtype)


def _paired_fields(formats: Formats) -> dict[str, np.dtype]:
  return {"fwd_dtype": formats[0], "bwd_dtype": formats[1]}


def _block_fields(formats: Formats) -> dict[str, np.dtype]:
  if formats[0] != formats[1]:
    raise ValueError(
      f"block scaling uses one format for every tensor, got forward {formats[0].name} and "
      f"backward {formats[1].name}; spell one, e.g. block:e4m3."
    )
  return {"dtype": formats[0]}


class _Named(NamedTuple):
  """A recipe the policy string names: its class, and how its formats map to its fields."""

  name: str
  cls: type
  formats: Callable[[Any], Formats]  # the recipe's (forward, backward) formats
  fields: Callable[[Formats], dict[str, np.dtype]]  # the constructor arguments for formats


RECIPE_NAMES = (
  _Named("current", recipes.CurrentScaling, _paired, _paired_fields),
  _Named("delayed", recipes.DelayedScaling, _paired, _paired_fields),
  _Named("rowwise", recipes.RowwiseScaling, _paired, _paired_fields),
  _Named("block", recipes.BlockScaling, lambda r: (r.dtype, r.dtype), _block_fields),
  _Named("mxfp8", recipes.Mxfp8Scaling, _paired, _paired_fields),
)
_BY_NAME = {named.name: named for named in RECIPE_NAMES}
_BY_CLASS = {named.cls: named for named in RECIPE_NAMES}
_DEFAULT = _BY_NAME["current"]
_ACCEPTED = (
  f"a recipe ({', '.join(_BY_NAME)}), formats ({', '.join(_FORMATS)}, or forward/backward "
  "formats such as f8e4m3/f8e5m2), recipe:formats such as delayed:hybrid, or none"
)


def _check_hashable(recipe: Any) -> None:
  try:
    hash(recipe)
  except TypeError:
    raise TypeError(
      f"The fp8 recipe {recipe!r} is not hashable; a recipe is static under jit (a frozen "
      "dataclass, as the fp8 recipes are)."
    ) from None


@dataclasses.dataclass(frozen=True)
class Fp8Policy:
  """A precision policy plus the fp8 recipe of its matmuls (hashable, jit-static).

  ``str(p)`` spells it back, e.g. ``"p=f32,c=bf16,o=f32,fp8=current"``: the
  recipe's name and, when they are not its defaults, its formats
  (``"fp8=delayed:e4m3"``); the other fields of a recipe (history length,
  margin, ...) are not spelled. A recipe of another class is spelled by its
  class name, which does not parse back.

  Attributes:
    policy: the dtypes of everything that is not an fp8 matmul (its compute
      dtype is never fp8).
    config: the fp8 recipe of the matmuls: any :class:`Fp8Recipe` (the five
      recipes of :mod:`jmp_lite.fp8` implement it; an :class:`Fp8Config` is
      :class:`DelayedScaling` with its fields, and is stored as one), by
      default ``CurrentScaling()``; ``None`` for no fp8.

  Raises:
    TypeError: for a ``policy`` that is not a :class:`~jmp_lite.Policy`, or a
      ``config`` that is not a hashable recipe.
    ValueError: for a policy whose compute dtype is fp8.

  >>> str(Fp8Policy(jl.get_policy("p=f32,c=bf16,o=f32")))
  'p=f32,c=bf16,o=f32,fp8=current'
  >>> delayed = jl.fp8.DelayedScaling(bwd_dtype=jl.fp8.E4M3)
  >>> str(Fp8Policy(jl.get_policy("p=f32,c=bf16,o=f32"), delayed))
  'p=f32,c=bf16,o=f32,fp8=delayed:e4m3'
  """

  policy: Policy
  config: recipes.Fp8Recipe | None = dataclasses.field(default_factory=recipes.CurrentScaling)

  def __post_init__(self):
    if not isinstance(self.policy, Policy):
      raise TypeError(f"policy must be a jmp_lite Policy, got {type(self.policy).__name__}.")
    if dtypes.is_float8(self.policy.compute_dtype):
      raise ValueError(
        f"Fp8Policy.policy has compute dtype {np.dtype(self.policy.compute_dtype).name}; use a "
        "16/32-bit compute dtype for non-matmul ops and put the fp8 recipe in config."
      )
    if self.config is not None:
      recipe = recipes.as_recipe(self.config)
      _check_hashable(recipe)
      object.__setattr__(self, "config", recipe)

  def __str__(self) -> str:
    if self.config is None:
      return str(self.policy)
    return f"{self.policy},{FP8_KEY}={recipe_name(self.config)}"


def _formats_name(formats: Formats) -> str:
  for name, known in _FORMATS.items():
    if known == formats:
      return name
  return f"{dtypes.dtype_name(formats[0])}/{dtypes.dtype_name(formats[1])}"


def recipe_name(recipe: Any) -> str:
  """The ``fp8=`` value that spells ``recipe`` (its class name if the string names none).

  Args:
    recipe: an fp8 recipe.

  Returns:
    ``"current"``, ``"delayed:e4m3"``, ... as the module docstring's grammar.
  """
  named = _BY_CLASS.get(type(recipe))
  if named is None:
    return type(recipe).__name__
  formats = named.formats(recipe)
  if formats == named.formats(named.cls()):
    return named.name
  return f"{named.name}:{_formats_name(formats)}"


def _formats_of(value: str, spec: str) -> Formats:
  if value in _FORMATS:
    return _FORMATS[value]
  fwd, sep, bwd = value.partition("/")
  if not sep:
    raise ValueError(f"Unknown fp8 recipe {value!r} in policy {spec!r}; expected {_ACCEPTED}.")
  try:
    return (as_fp8_dtype(fwd.strip(), "fp8 forward format"),
            as_fp8_dtype(bwd.strip(), "fp8 backward format"))  # fmt: skip
  except (TypeError, ValueError) as e:
    raise ValueError(f"In policy {spec!r}: {e}") from e


def _check_options(cls: type, options: dict[str, Any], spelled: dict[str, Any], spec: Any) -> None:
  """Raises naming the keyword options ``cls`` does not have, or that the string spelled."""
  accepted = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(options) - set(accepted))
  if unknown:
    raise ValueError(
      f"fp8 options {unknown} given for {cls.__name__} (policy {spec!r}); its options are "
      f"{accepted}."
    )
  twice = sorted(set(options) & set(spelled))
  if twice:
    raise ValueError(
      f"fp8 options {twice} given as keywords and by the formats of policy {spec!r}; give them "
      "once."
    )


def _build(named: _Named, formats: Formats | None, options: dict[str, Any], spec: Any) -> Any:
  """``named``'s recipe with ``formats`` (its defaults for ``None``) and the keyword options."""
  fields = {} if formats is None else named.fields(formats)
  _check_options(named.cls, options, fields, spec)
  return named.cls(**fields, **options)


def parse_recipe(value: str, spec: str, options: dict[str, Any]) -> Any:
  """The recipe of an ``fp8=`` value, with keyword ``options``; ``None`` for no fp8.

  Args:
    value: the value, lower case.
    spec: the whole policy string, for the error messages.
    options: further fields of the recipe (e.g. ``amax_history_length``).

  Returns:
    The recipe, or ``None`` for ``none``/``off``.

  Raises:
    ValueError: naming ``value`` and what is accepted, for an unknown recipe or
      format, and naming the options a recipe does not have.
  """
  if value in ("none", "off"):
    if options:
      raise ValueError(f"fp8 options {sorted(options)} given for a policy without fp8.")
    return None
  name, sep, formats = (part.strip() for part in value.partition(":"))
  if name in _BY_NAME:
    if sep and not formats:
      raise ValueError(f"Missing formats after {name!r}: in policy {spec!r}; expected {_ACCEPTED}.")
    return _build(_BY_NAME[name], _formats_of(formats, spec) if sep else None, options, spec)
  if sep:
    raise ValueError(
      f"Unknown fp8 recipe {name!r} in {value!r} in policy {spec!r}; expected {_ACCEPTED}."
    )
  return _build(_DEFAULT, _formats_of(value, spec), options, spec)


def get_fp8_policy(spec: str | Policy | Fp8Policy, **config_kwargs: Any) -> Fp8Policy:
  """Parses a policy with fp8 matmuls.

  Two spellings:

  * :func:`~jmp_lite.get_policy`'s grammar plus an ``fp8=`` key:
    ``"p=f32,c=bf16,o=f32,fp8=current"`` runs Dense/DenseGeneral/Einsum
    matmuls in fp8 with per-tensor current scaling (E4M3 forward, E5M2
    backward) and everything else as ``p=f32,c=bf16,o=f32``. The value names
    a recipe (``current``, ``delayed``, ``rowwise``, ``block``, ``mxfp8``),
    formats (``hybrid``, ``e4m3``, ``e5m2``, ``<fwd>/<bwd>``: the default
    recipe, current scaling, with them), both (``delayed:hybrid``), or
    ``none``. ``"fp8=current"`` alone keeps everything else in float32.
  * an fp8 compute dtype, which :func:`~jmp_lite.get_policy` already accepts:
    ``"p=f32,c=f8e4m3"`` means current-scaled fp8 matmuls with that forward
    format (E5M2 backward for E4M3) and everything else in the param dtype.

  Args:
    spec: the string, a :class:`~jmp_lite.Policy` (no fp8 unless its compute
      dtype is fp8), or an :class:`Fp8Policy` (returned as is when no
      ``config_kwargs`` are given).
    **config_kwargs: further fields of the recipe (e.g. ``power_of_2`` for
      current scaling; ``amax_history_length``, ``amax_compute_algo``,
      ``margin``, ``first_step`` for delayed scaling).

  Returns:
    The :class:`Fp8Policy`; its ``config`` is ``None`` when ``spec`` asks for
    no fp8.

  Raises:
    ValueError: for what :func:`~jmp_lite.get_policy` rejects, an unknown
      recipe or format (naming it and the accepted ones), both an fp8 compute
      dtype and an ``fp8=`` value, or ``config_kwargs`` the recipe does not
      have (or for a policy without fp8).
    TypeError: for an argument that is not a string or policy.

  >>> str(get_fp8_policy("params=float32, compute=bfloat16, output=float32, fp8=hybrid"))
  'p=f32,c=bf16,o=f32,fp8=current'
  >>> get_fp8_policy("p=f32,c=bf16,fp8=rowwise").config
  RowwiseScaling(fwd_dtype=dtype(float8_e4m3fn), bwd_dtype=dtype(float8_e4m3fn), ...)
  >>> str(get_fp8_policy("p=f32,c=f8e4m3"))
  'p=f32,c=f32,o=f32,fp8=current'
  """
  if isinstance(spec, Fp8Policy):
    if not config_kwargs:
      return spec
    if spec.config is None:
      raise ValueError(f"fp8 options {sorted(config_kwargs)} given for a policy without fp8.")
    recipe: Any = spec.config
    if type(recipe) not in _BY_CLASS:
      raise ValueError(
        f"fp8 options {sorted(config_kwargs)} given for {type(recipe).__name__}, which is not "
        f"one of the named recipes ({', '.join(_BY_NAME)}); build the recipe instead."
      )
    _check_options(type(recipe), config_kwargs, {}, spec)
    return dataclasses.replace(spec, config=dataclasses.replace(recipe, **config_kwargs))
  _validation.check_type(
    spec,
    (Policy, str),
    "get_fp8_policy expects a string such as 'p=f32,c=bf16,o=f32,fp8=current', a Policy or an "
    "Fp8Policy",
  )
  value: str | None = None
  if isinstance(spec, Policy):
    base = spec
  else:
    parsed = parse_spec(spec, fp8=True)
    base, value = policy_of(parsed, spec), parsed.values.get(FP8_KEY)
  if dtypes.is_float8(base.compute_dtype):
    if value is not None:
      raise ValueError(
        f"Policy {spec!r} gives both an fp8 compute dtype and an fp8= recipe; use one of them."
      )
    formats = (as_fp8_dtype(base.compute_dtype, "compute dtype"), E5M2)
    base = Policy(base.param_dtype, base.param_dtype, base.output_dtype)
    return Fp8Policy(base, _build(_DEFAULT, formats, config_kwargs, spec))
  if value is None:
    if config_kwargs:
      raise ValueError(f"fp8 options {sorted(config_kwargs)} given for a policy without fp8.")
    return Fp8Policy(base, None)
  return Fp8Policy(base, parse_recipe(value, str(spec), config_kwargs))
