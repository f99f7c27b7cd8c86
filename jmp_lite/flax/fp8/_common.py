"""What the linen and NNX halves of ``jmp_lite.flax.fp8`` share (private).

The fp8 spec a user gives: a recipe, a policy or a policy string.
"""

from __future__ import annotations

from typing import Any

from jmp_lite import fp8
from jmp_lite._policy import Fp8Policy, Policy, get_fp8_policy


def config_of_spec(spec: Any) -> Any:
  """The fp8 recipe a spec asks for (``None``: no fp8).

  Args:
    spec: an fp8 recipe (:class:`~jmp_lite.fp8.Fp8Recipe`, e.g.
      :class:`~jmp_lite.fp8.CurrentScaling`; an :class:`~jmp_lite.fp8.Fp8Config`
      is :class:`~jmp_lite.fp8.DelayedScaling`), ``None`` (``CurrentScaling()``), an
      :class:`~jmp_lite.fp8.Fp8Policy`, a :class:`~jmp_lite.Policy` (no fp8
      unless its compute dtype is fp8) or a policy string such as
      ``"p=f32,c=bf16,o=f32,fp8=hybrid"``.

  Returns:
    The recipe, or ``None`` for a policy without fp8 (a policy's ``fp8=`` names
    the formats of :class:`~jmp_lite.fp8.DelayedScaling`).
  """
  if isinstance(spec, (str, Policy, Fp8Policy)):
    config = get_fp8_policy(spec).config
    return None if config is None else fp8.as_recipe(config)
  try:
    return fp8.as_recipe(spec)
  except TypeError:
    raise TypeError(
      "Expected an fp8 recipe (fp8.CurrentScaling, fp8.DelayedScaling, an Fp8Config), an "
      "Fp8Policy, a Policy or a policy string such as "
      f"'p=f32,c=bf16,o=f32,fp8=hybrid'; got {spec!r} of type {type(spec).__name__}."
    ) from None
