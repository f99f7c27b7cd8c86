"""What the linen and NNX halves of ``jmp_lite.flax.fp8`` share (private).

The fp8 spec a user gives (a config, a policy or a policy string), and the
loss scale the fp8 ops read while they are traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jmp_lite._context import Ambient
from jmp_lite._fp8_config import Fp8Config, as_config
from jmp_lite._policy import Fp8Policy, Policy, get_fp8_policy

# The loss scale the gradients carry, for the fp8 ops traced inside loss_scale_scope().
LOSS_SCALE: Ambient[Any] = Ambient("jmp_lite.flax.fp8.loss_scale")


@contextlib.contextmanager
def loss_scale_scope(loss_scale: Any) -> Iterator[None]:
  """Tells the fp8 ops traced inside which loss scale the gradients carry.

  The ops quantize the output gradient with its scale times the loss scale and
  record its amax divided by it (see :func:`jmp_lite.fp8.dot_general`).

  Args:
    loss_scale: a number, a scalar array (a tracer inside ``jit`` is fine: it
      is read while tracing), a jmp_lite loss scale, or ``None`` (1).

  Returns:
    A context manager; scopes nest, the innermost wins.
  """
  with LOSS_SCALE.scope(loss_scale):
    yield


def op_options(config: Fp8Config, **options: Any) -> dict[str, Any]:
  """Keyword arguments of an fp8 op call: ``config``, the current loss scale, ``options``.

  Called when the op is traced: the loss scale is a tracer of the step being
  traced.
  """
  return {"config": config, "loss_scale": LOSS_SCALE.current(), **options}


def config_of_spec(spec: Any) -> Fp8Config | None:
  """The fp8 config a spec asks for (``None``: no fp8).

  Args:
    spec: an :class:`~jmp_lite.fp8.Fp8Config`, ``None`` (``Fp8Config()``), an
      :class:`~jmp_lite.fp8.Fp8Policy`, a :class:`~jmp_lite.Policy` (no fp8
      unless its compute dtype is fp8) or a policy string such as
      ``"p=f32,c=bf16,o=f32,fp8=hybrid"``.

  Returns:
    The :class:`~jmp_lite.fp8.Fp8Config`, or ``None`` for a policy without fp8.
  """
  if isinstance(spec, (str, Policy, Fp8Policy)):
    return get_fp8_policy(spec).config
  try:
    return as_config(spec)  # a config, or None
  except TypeError:
    raise TypeError(
      "Expected an Fp8Config, an Fp8Policy, a Policy or a policy string such as "
      f"'p=f32,c=bf16,o=f32,fp8=hybrid'; got {spec!r} of type {type(spec).__name__}."
    ) from None
