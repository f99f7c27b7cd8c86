"""fp8 matmuls for Flax layers, linen and NNX, applied from outside the model.

The layers whose matmuls become fp8 (:mod:`jmp_lite.fp8`):

========================  ==========================  ==================================
layer                     linen                       NNX
========================  ==========================  ==================================
dense                     ``nn.Dense``                ``nnx.Linear``
general dense             ``nn.DenseGeneral``         ``nnx.LinearGeneral``
einsum                    ``nn.Einsum``               ``nnx.Einsum``
========================  ==========================  ==================================

**linen**: inside ``with linen_fp8(config):`` every such layer computes its
matmul with :func:`jmp_lite.fp8.dot_general` (an ``nn.intercept_methods``
interceptor; the model code is unchanged). Each layer keeps an
:class:`~jmp_lite.fp8.Fp8DotState` in the ``"fp8_state"`` collection, created
by ``init``, and reads an optional :class:`~jmp_lite.fp8.Fp8DotAmax` probe from
the ``"fp8_amax"`` collection::

  with linen_fp8(config):
    variables = model.init(key, x)       # {"params": ..., "fp8_state": ...}

  def loss_fn(params, amax):
    with linen_fp8(config, loss_scale=loss_scale):
      y = model.apply({"params": params, "fp8_state": fp8_state, "fp8_amax": amax}, x)
    return loss(y)

  _, (grads, amax) = jl.scaled_value_and_grad(loss_fn, loss_scale, argnums=(0, 1))(
      params, fp8.zeros_amax(fp8_state))
  fp8_state = fp8.update(fp8_state, amax, config)

Layers whose user already set ``dot_general``/``dot_general_cls`` keep it. The
explicit alternative to interception is ``nn.Dense(..., dot_general_cls=
functools.partial(LinenFp8DotGeneral, config=config))``.

**NNX**: :func:`nnx_fp8` installs an fp8 op into each layer's ``dot_general``
/ ``einsum_op`` slot; the op holds the state as :class:`Fp8State` variables and
the probes as :class:`Fp8Amax` variables. :func:`nnx_value_and_grad`
differentiates with respect to both the parameters and the probes and folds
the observations into the state in place.

The loss scale the gradients carry is passed where the ops are set up:
``linen_fp8(..., loss_scale=)`` (and :func:`linen_interceptor`) give it to
every op they run, :class:`LinenFp8DotGeneral` takes it as a field, and
``nnx_value_and_grad(..., loss_scale=)`` sets each NNX op's
:class:`Fp8LossScale` variable for the differentiation it runs.

The recipe decides the state: with :class:`~jmp_lite.fp8.CurrentScaling`
(the default) layers keep none (no ``"fp8_state"`` collection, no
:class:`Fp8State` variables). With delayed scaling a fresh state has no scales
yet and its first step quantizes each tensor with its own amax; to set the
scales from a first batch instead (:func:`jmp_lite.fp8.calibrate`): linen's
``"fp8_state"`` is a pytree of :class:`~jmp_lite.fp8.Fp8DotState`, so
``fp8.calibrate`` applies to it as is; for NNX, ``nnx_calibrate(loss_fn)(model, *batch)``.

Which layers run in fp8 is an :class:`~jmp_lite.fp8.Fp8Placement`
(``placement=``; by default not the first and last matmul layers, nor matmuls
too small to pay); :func:`placement_report` says where each layer ran, and why.

The modules behind this namespace: ``_linen`` (interception and explicit
injection), ``_nnx`` (the ops NNX layers hold, and the NNX training helpers),
``_placement`` (the report, the checks of a placement and its warning) and
``_common`` (the fp8 spec both halves read).
"""

from jmp_lite.flax.fp8._linen import (
  AMAX_COLLECTION,
  STATE_COLLECTION,
  VARIABLE_NAME,
  LinenFp8DotGeneral,
  linen_fp8,
  linen_interceptor,
)
from jmp_lite.flax.fp8._nnx import (
  Fp8Amax,
  Fp8LossScale,
  Fp8State,
  NnxFp8DotGeneral,
  NnxFp8Einsum,
  nnx_calibrate,
  nnx_fp8,
  nnx_update,
  nnx_value_and_grad,
)
from jmp_lite.flax.fp8._placement import (
  Fp8PlacementWarning,
  LayerPlacement,
  PlacementReport,
  placement_report,
)

__all__ = (
  # linen
  "linen_fp8",
  "linen_interceptor",
  "LinenFp8DotGeneral",
  "STATE_COLLECTION",
  "AMAX_COLLECTION",
  "VARIABLE_NAME",
  # NNX
  "nnx_fp8",
  "nnx_value_and_grad",
  "nnx_calibrate",
  "nnx_update",
  "NnxFp8DotGeneral",
  "NnxFp8Einsum",
  "Fp8State",
  "Fp8Amax",
  "Fp8LossScale",
  # Where fp8 ran
  "placement_report",
  "PlacementReport",
  "LayerPlacement",
  "Fp8PlacementWarning",
)
