r"""fp8 matmuls (E4M3 forward, E5M2 backward), each tensor scaled as a recipe says.

How each tensor is scaled is a recipe (:class:`Fp8Recipe`), passed as
``config=``: :class:`CurrentScaling` (the default) scales each tensor by its
own amax, just in time, and keeps no state; :class:`DelayedScaling` (an
:class:`Fp8Config`) scales it from the amaxes of earlier steps, as below.

An fp8 matmul quantizes each operand with its own scale :math:`s`, multiplies
the 8-bit values with fp32 accumulation, and multiplies the result back by the
scales:

.. math::

  q(x) = \mathrm{fp8}\big(\mathrm{sat}(x / s_x)\big), \qquad
  y = \big(q(x) \cdot q(k)\big)_{\text{fp32}} \; s_x s_k

where :math:`\mathrm{sat}` clips finite values to the format's largest value
(448 for E4M3, 57344 for E5M2; see :data:`jmp_lite.FORMATS`). In the backward
pass the output gradient :math:`g` is quantized to E5M2 with its own scale
:math:`s_g` (gradients need range more than precision), and

.. math::

  \partial x = \big(q(g) \cdot q(k)^\top\big)_{\text{fp32}} \; s_g s_k, \qquad
  \partial k = \big(q(x)^\top \cdot q(g)\big)_{\text{fp32}} \; s_x s_g .

Delayed scaling picks each scale from the absolute maxima (amax) seen in
earlier steps: the state of one tensor is its current scale and a history of
the last :math:`L` amaxes (:class:`Fp8ScaleState`). After a step that observed
:math:`a_t = \max |x_t|`,

.. math::

  h \leftarrow (a_t, h_0, \dots, h_{L-2}), \qquad
  A = \begin{cases} \max_i h_i & \texttt{"max"} \\ h_0 & \texttt{"most_recent"}\end{cases},
  \qquad
  s \leftarrow \begin{cases}
    A \cdot 2^{\text{margin}} / \text{fp8\_max} & 0 < A < \infty \\
    s & \text{otherwise (keep the previous scale)}
  \end{cases}

The step itself only *reads* the scales; what it observed comes back as the
gradient of a zero-valued "amax probe" (:class:`Fp8DotAmax`), because the
output-gradient amax exists only in the backward pass. :func:`update` then
folds the observations into the state, outside differentiation. Observations
from several devices or gradient-accumulation microsteps are combined with
``max`` (:func:`reduce_amax`, :func:`combine_amax`), never summed.

A fresh state has no scales yet (0): the matmul quantizes such a tensor with
its own amax, so the first step's error is rounding only, not a flush to zero
or a saturation. :func:`calibrate` fills the history from one batch before
training instead, with one pass under :func:`current_scaling`.

>>> from jmp_lite import fp8
>>> config = fp8.Fp8Config(amax_history_length=4)
>>> x, k = jnp.full((2, 3), 56.0), jnp.full((3, 2), 896.0)
>>> def loss_fn(k, state, amax):
...   y = fp8.dot_general(x, k, (((1,), (0,)), ((), ())), state, amax, config=config)
...   return jnp.sum(y) * (57344 * 2.0**-20)    # output gradients of 57344 * 2**-20
>>> state = fp8.init_dot_state(config)           # one per matmul, in any pytree
>>> state = fp8.calibrate(lambda amax: loss_fn(k, state, amax), state, config)
>>> [float(t.scale) for t in state]              # amax / fp8_max
[0.125, 2.0, 9.5367431640625e-07]
>>> grads, amax = jax.grad(loss_fn, argnums=(0, 2))(k, state, fp8.zeros_amax(state))
>>> state = fp8.update(state, amax, config)      # axis_name=... under shard_map/pmap
>>> float(amax.kernel), float(loss_fn(k, state, None))
(896.0, 32928.0)

The modules behind this namespace: ``jmp_lite._fp8_config`` (:class:`Fp8Config`
and its checks, below the policy module),
``_scaling`` (the state and its update rules), ``_quantize``, ``_recipes``
(:class:`Fp8Recipe`, the recipes and :func:`dot_general`), ``_matmul`` (the
per-tensor matmul and its VJP), ``_sharding`` (its shard_map and
explicit-sharding typing), ``_placement`` (:class:`Fp8Placement`: which layers
of a Flax model run in fp8), ``_einsum`` and ``_current_scaling``
(:func:`current_scaling`, :func:`calibrate`) and ``_fp8_policy``
(:class:`Fp8Policy` and :func:`get_fp8_policy`: a policy plus a recipe, in
``jmp_lite._policy``'s grammar).
See ``docs/fp8.md`` for the design, the Flax integration
(:mod:`jmp_lite.flax.fp8`) and the differences from ``flax.linen.fp8_ops``.
"""

from jmp_lite._fp8_config import (
  AMAX_COMPUTE_ALGOS,
  E4M3,
  E5M2,
  FAST_ACCUMULATION,
  Fp8Config,
)
from jmp_lite.fp8._current_scaling import CurrentScalingScope, calibrate, current_scaling
from jmp_lite.fp8._einsum import einsum
from jmp_lite.fp8._fp8_policy import Fp8Policy, get_fp8_policy
from jmp_lite.fp8._mx import native_support as mxfp8_native_support
from jmp_lite.fp8._placement import ALL_LAYERS, Fp8Placement, MatmulRoofline, ShapeRule
from jmp_lite.fp8._quantize import compute_amax, dequantize, quantize, quantize_dequantize
from jmp_lite.fp8._recipes import (
  BlockScaling,
  CurrentScaling,
  DelayedScaling,
  Fp8Recipe,
  Mxfp8Scaling,
  RowwiseScaling,
  as_recipe,
  dot_general,
)
from jmp_lite.fp8._scaling import (
  Fp8DotAmax,
  Fp8DotState,
  Fp8ScaleState,
  combine_amax,
  compute_scale,
  init_dot_state,
  init_scale_state,
  reduce_amax,
  update,
  update_scale,
  zeros_amax,
)

__all__ = (
  # Configuration and policies
  "Fp8Config",
  "E4M3",
  "E5M2",
  "AMAX_COMPUTE_ALGOS",
  "FAST_ACCUMULATION",
  "Fp8Policy",
  "get_fp8_policy",
  # Recipes: how each tensor is scaled
  "Fp8Recipe",
  "CurrentScaling",
  "DelayedScaling",
  "RowwiseScaling",
  "BlockScaling",
  "Mxfp8Scaling",
  "mxfp8_native_support",
  "as_recipe",
  # Where fp8 runs
  "Fp8Placement",
  "ALL_LAYERS",
  "MatmulRoofline",
  "ShapeRule",
  # The matmuls
  "dot_general",
  "einsum",
  # Delayed-scaling state
  "Fp8ScaleState",
  "Fp8DotState",
  "Fp8DotAmax",
  "init_scale_state",
  "init_dot_state",
  "zeros_amax",
  # Scale updates
  "update",
  "update_scale",
  "compute_scale",
  "reduce_amax",
  "combine_amax",
  # The first step: current scaling and calibration
  "calibrate",
  "current_scaling",
  "CurrentScalingScope",
  # Quantization
  "quantize",
  "dequantize",
  "quantize_dequantize",
  "compute_amax",
)
