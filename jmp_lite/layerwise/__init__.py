r"""Layer-wise adaptive loss scaling (Zhao, Vogel, Ahmed, Luk 2019).

One loss scale for the whole network must keep the stage with the largest
gradients below fp16's maximum, so stages whose gradients are many powers of
two smaller still underflow. Here the model is a chain of *stages*
:math:`f = f_{K-1} \circ \dots \circ f_0` and stage :math:`k` has its own
power-of-two scale :math:`S_k`:

* The loss is multiplied by :math:`S_{K-1}`.
* Between stage :math:`k` and :math:`k+1` sits a *boundary*
  (:func:`stage_boundary`): the identity forward; backward it multiplies the
  cotangent by :math:`S_k / S_{k+1}`, so stage :math:`k`'s backward pass runs
  at scale :math:`S_k`. Both are powers of two, so the conversion is exact.
* Stage :math:`k`'s parameter gradients are divided by :math:`S_k`.

Inside a stage one scale holds, so residual branches that merge inside a block
stay consistent. The boundaries also report statistics of the cotangent they
see (max and a histogram of :math:`\lfloor \log_2 |g| \rfloor`) as the
gradient of a zero "probe" input, so ``jax.grad`` returns them with the
gradients: no host sync.

**Scale rule.** Every ``update_period`` finite steps each stage gets

.. math::

  S_k = 2^{\lfloor \log_2 (M \cdot 2^{-m} / a_k) \rfloor}

where :math:`a_k` is the largest true (unscaled) gradient magnitude seen in
stage :math:`k` (its parameter gradients and the cotangents at its boundaries)
over the last ``amax_history_length`` steps, :math:`M` the target format's max
(65504 for fp16) and :math:`m` = ``margin_bits`` of headroom: the largest
power of two that would not have overflowed on any of those steps. Among the
scales that keep the underflow fraction of a stage at or below
``underflow_fraction``, this is the largest one, which also keeps the most
mantissa bits for small values (subnormals lose precision). If even that scale
leaves more than ``underflow_fraction`` of the stage's values below the
format's smallest subnormal (the stage's own spread exceeds the format's
range), the stage is flagged in ``underflow_exceeded``. New scales apply from
the next step.

On a non-finite step the update is skipped. inf/NaN flows backwards from the
loss, so the stages closer to the loss than the one where the overflow started
stay finite and keep their scales, and the highest non-finite stage is where it
started: its true maximum was at least :math:`M / S_k`, which enters its
history, so its scale drops by :math:`2^m` (at least ``backoff_factor``) and
stays there while the overflow is in the history. The stages below it, which
only received its inf/NaN, back off by ``backoff_factor`` until the next
refresh.

Example (plain JAX; see :mod:`jmp_lite.flax` for Flax models)::

  def loss_fn(params, x, y):
    h = x
    for k, layer in enumerate(params):
      h = jnp.tanh(h @ layer["w"])
      if k < len(params) - 1:
        h = jl.stage_boundary(h, k)      # identity outside layer-wise training
    return jnp.mean((h - y) ** 2)

  scale = jl.LayerwiseLossScale(param_stages=[0, 1, 2, 3])  # a prefix of params
  tx = jl.loss_scaling(optax.adam(1e-3), scale)
  loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)
  updates, opt_state = tx.update(grads, opt_state, params)

The implementation is private: ``_boundary`` (the boundary and its
statistics), ``_stages`` (stage definitions), ``_scale`` and ``_rule`` (the
loss scale and its rule), ``_check`` (:func:`check_stages`).
"""

from jmp_lite.layerwise._boundary import HIST_BINS, HIST_MIN_EXP, BoundaryStats, stage_boundary
from jmp_lite.layerwise._check import check_stages
from jmp_lite.layerwise._scale import LayerwiseLossScale
from jmp_lite.layerwise._stages import StackedStages, StageTree, stages_from_paths

__all__ = (
  # Stages and their boundaries
  "stage_boundary",
  "StackedStages",
  "StageTree",
  "stages_from_paths",
  "BoundaryStats",
  "HIST_MIN_EXP",
  "HIST_BINS",
  # The scale rule
  "LayerwiseLossScale",
  # Debugging
  "check_stages",
)
