"""What the linen and NNX halves of ``jmp_lite.flax.fp8`` share (private).

The fp8 spec a user gives: a recipe, a policy or a policy string.
"""

from __future__ import annotations

from typing import Any

from jmp_lite import fp8
from jmp_lite._policy import Policy


def config_of_spec(spec: Any) -> Any:
  """The fp8 recipe a spec asks for (``None``: no fp8).

  Args:
    spec: an fp8 recipe (:class:`~jmp_lite.fp8.Fp8Recipe`, e.g.
      :class:`~jmp_lite.fp8.CurrentScaling`; an :class:`~jmp_lite.fp8.Fp8Config`
      is :class:`~jmp_lite.fp8.DelayedScaling`), ``None`` (``CurrentScaling()``), an
      :class:`~jmp_lite.fp8.Fp8Policy`, a :class:`~jmp_lite.Policy` (no fp8
      unless its compute dtype is fp8) or a policy string such as
      ``"p=f32,c=bf16,o=f32,fp8=current"``.

  Returns:
    The recipe (a policy's ``config``), or ``None`` for a policy without fp8.
  """
  if isinstance(spec, (str, Policy, fp8.Fp8Policy)):
    return fp8.get_fp8_policy(spec).config
  try:
    return fp8.as_recipe(spec)
  except TypeError:
    raise TypeError(
      "Expected an fp8 recipe (fp8.CurrentScaling, fp8.DelayedScaling, fp8.RowwiseScaling, "
      "fp8.BlockScaling, fp8.Mxfp8Scaling, an Fp8Config), an "
      "Fp8Policy, a Policy or a policy string such as "
      f"'p=f32,c=bf16,o=f32,fp8=current'; got {spec!r} of type {type(spec).__name__}."
    ) from None
