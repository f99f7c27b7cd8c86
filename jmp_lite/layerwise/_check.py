r"""``check_stages``: does every parameter's gradient come from its own stage?

The scaled gradient of a parameter of stage :math:`s` is its true gradient
times :math:`S_s`, and doubling :math:`S_0, \dots, S_j` (the ratio at boundary
:math:`j`) doubles the part of every gradient that flows through boundary
:math:`j` and leaves the rest alone. The check measures, for every parameter,
the share of its gradient that each doubling moves: 1 for :math:`j \ge s`, 0
below, for a correct staging. It runs on the host, once, as a debugging aid.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _transform as transform
from jmp_lite import _validation
from jmp_lite.layerwise._boundary import StatsMode, with_boundaries, zero_probes
from jmp_lite.layerwise._scale import LayerwiseLossScale
from jmp_lite.layerwise._stages import Spec, StackedStages, check_stacked, leaf_specs

_HEADROOM_BITS = 6
"""check_stages puts each stage's largest boundary cotangent this many powers of two below the
format's max: one for the doubling, the rest for parameter gradients (sums over the batch) and
values inside a stage larger than those at its boundaries."""
_MAX_EXP = 100
"""Bound on |log2| of check_stages's loss scale and of its ratio between adjacent stages."""

# (name, stage, scaled gradient, change when every scale doubles, share per boundary)
_Row = tuple[str, int, np.ndarray, np.ndarray, list[float]]


def check_stages(
  fun: Callable[..., Any],
  loss_scale: Any,
  params: Any,
  *args: Any,
  has_aux: bool = False,
  tolerance: float = 1e-3,
  **kwargs: Any,
) -> None:
  r"""Checks that every parameter's gradient comes from the stage it is assigned to.

  A debugging aid for the plain-JAX API, where nothing else catches a parameter
  used in two stages (tied weights), a tensor that bypasses a boundary (a skip
  connection across stages) or a wrong index in ``param_stages``: each gives
  silently wrong gradients. Compiles the gradient of ``fun(params, *args,
  **kwargs)`` once (a later check of the same ``fun`` reuses it when ``args``
  and ``kwargs`` are arrays of the same shapes), runs it a few times to choose
  scales and then once per boundary: a small batch is enough.

  How: the scaled gradient of a parameter of stage :math:`s` is its true
  gradient times :math:`S_s`, and doubling :math:`S_0, \dots, S_j` (the ratio
  at boundary :math:`j`) doubles the part of every gradient that flows through
  boundary :math:`j` and leaves the rest alone. With :math:`\hat g` a scaled
  gradient, :math:`\hat g_j` the same after the doubling and :math:`d` its
  change when every scale doubles (:math:`\hat g` itself, in exact arithmetic),

  .. math::

    \text{share}_j = \langle d, \hat g_j - \hat g \rangle / \|d\|^2

  is 1 for :math:`j \ge s` and 0 for :math:`j < s`; any other share means part
  of the gradient crossed boundaries its stage does not account for. All runs
  execute the same compiled program, and multiplying by a power of two commutes
  with rounding while values stay in the format's normal range, so the shares
  of a correct staging are exactly 0 and 1, in fp16 and bf16 too. To keep the
  values in that range the check picks its own power-of-two scales, not
  ``loss_scale``'s (under which deep stages may underflow): from the loss down,
  each stage's largest boundary cotangent goes 6 powers of two below the max of
  ``loss_scale.gradient_dtype``, lower where a stage overflowed. The shares it
  reports for a wrong staging are measured at these scales (a tensor that
  bypasses a boundary mixes values of two scales, so they depend on them).
  Only values that round to subnormals or zero make a correct share deviate
  from 0 or 1; ``tolerance`` absorbs that, while a wrong stage deviates by 1.

  Args:
    fun: the loss function, differentiated with respect to ``params``.
    loss_scale: a :class:`LayerwiseLossScale`, or an optimizer state holding
      one: its ``param_stages`` are checked; its scales are the first guess.
    params: the parameters ``fun`` takes first.
    *args: the other positional arguments of ``fun`` (e.g. a small batch).
    has_aux: ``fun`` returns ``(loss, aux)``.
    tolerance: the largest accepted deviation of a share from 0 or 1, in
      ``[0, 1)``.
    **kwargs: keyword arguments of ``fun``.

  Returns:
    None: a correct staging passes silently.

  Raises:
    ValueError: naming every parameter (or slice of a stacked one) whose
      gradient does not come from its stage, with the share of it that flows
      through each boundary and the largest deviation; or if the gradients are
      not finite at any scale the check tried.
  """
  scale = transform.get_loss_scale(loss_scale)
  if not isinstance(scale, LayerwiseLossScale):
    raise TypeError(f"check_stages needs a LayerwiseLossScale, got {type(scale).__name__}.")
  tolerance = _validation.as_real(tolerance, "tolerance", "in [0, 1)")
  if not 0 <= tolerance < 1:
    raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}.")
  num_stages: int = scale.num_stages  # type: ignore[assignment]  # an int after __post_init__
  if num_stages == 1:
    return
  scaled_grads = _scaled_grads_fn(fun, params, args, kwargs, has_aux)
  specs = leaf_specs(scale.param_stages, params)
  exps, grads, all_doubled = _choose_scales(scaled_grads, scale, specs)
  rows = _shares(scaled_grads, exps, grads, all_doubled, specs)
  problems = _problems(rows, num_stages, tolerance)
  if problems:
    raise ValueError(
      "These parameters' gradients do not come from their stage alone. Share of each "
      "gradient through boundaries 0, 1, ... (stage s expects 0 below boundary s, 1 from "
      f"it on; deviations up to {tolerance:g} are accepted):\n" + "\n".join(problems) + "\n"
      "A parameter may be used in two stages, a tensor may bypass a boundary, or "
      "param_stages may be wrong."
    )


def _scaled_grads_fn(fun, params, args, kwargs, has_aux):
  """``exps -> (scaled gradients, boundary maxima)`` at the scales ``2**exps``, compiled once.

  When ``args`` and ``kwargs`` hold only arrays they are arguments of the compiled function,
  so checking the same loss again (other stages, other values) reuses it; otherwise they are
  constants of a function compiled for this call.
  """
  if not (
    isinstance(fun, Hashable)
    and all(isinstance(x, _ARRAYS) for x in jax.tree.leaves((args, kwargs)))
  ):
    fun = _Bound(fun, args, kwargs)
    args, kwargs = (), {}

  def scaled_grads(exps):
    # Only the ratios and the loss's scale enter: the scales themselves need no float32 range.
    ratios = np.ldexp(1.0, exps[:-1] - exps[1:]).astype(np.float32)
    top = np.float32(np.ldexp(1.0, exps[-1]))
    return _grads_and_boundary_amax(fun, has_aux, ratios, top, params, args, kwargs)

  return scaled_grads


_ARRAYS = (jax.Array, np.ndarray, np.generic)


class _Bound:
  """``fun`` with its other arguments fixed: a new function (and compilation) per check."""

  def __init__(self, fun, args, kwargs):
    self.fun, self.args, self.kwargs = fun, args, kwargs

  def __call__(self, params):
    return self.fun(params, *self.args, **self.kwargs)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads_and_boundary_amax(fun, has_aux, ratios, top, params, args, kwargs):
  # The boundary maxima on every call: they set the scales.
  mode = StatsMode(histograms=False, max_every_step=True)

  def scaled_loss(p, probes):
    out = with_boundaries(fun, mode, ratios, jnp.float32(1))(p, *args, probes, **kwargs)
    return (out[0] if has_aux else out) * top

  grads, stats = jax.grad(scaled_loss, argnums=(0, 1))(params, zero_probes(ratios.shape[0]))
  return grads, stats.amax


def _choose_scales(scaled_grads, scale, specs):
  """Scales (as exponents) that keep every stage's values in the format's normal range.

  Returns:
    ``(exps, grads, all_doubled)``: the exponents, and the scaled gradients at
    ``2**exps`` and at ``2**(exps + 1)``.
  """
  num_stages = scale.num_stages
  target = dtypes.format_info(scale.gradient_dtype).max * 2.0**-_HEADROOM_BITS
  exps = np.log2(np.asarray(scale.scales, np.float64))  # a first guess
  exps = np.clip(np.nan_to_num(np.round(exps)), -_MAX_EXP, _MAX_EXP).astype(np.int64)
  ceiling = np.full(num_stages, np.iinfo(np.int64).max)
  # The search runs with every scale doubled, the most any later run doubles, so
  # that those stay finite too. Once a stage is well scaled, its boundary
  # cotangent scales the stage below: every run fixes at least one more stage.
  for attempt in range(num_stages + 8):
    all_doubled, boundary_amax = scaled_grads(exps + 1)
    fit, finite = _stage_fit(all_doubled, specs, boundary_amax, exps + 1, target)
    new = _next_exps(fit, finite, exps, ceiling)
    if np.array_equal(new, exps) or attempt == num_stages + 7:
      break
    exps = new
  grads, boundary_amax = scaled_grads(exps)
  finite &= _stage_fit(grads, specs, boundary_amax, exps, target)[1]
  if not finite.all():
    raise ValueError(
      "check_stages needs finite gradients, but the backward pass of stages "
      f"{np.flatnonzero(~finite).tolist()} gave inf or NaN at every scale it tried (the last: "
      f"2**{exps.tolist()}). Is the loss finite?"
    )
  return exps, grads, all_doubled


def _rows_of(tree: Any, specs: list[Spec]) -> Iterator[tuple[str, int, np.ndarray]]:
  """(name, stage, gradient) per parameter, or per slice of a stacked one."""
  for (path, g), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], specs, strict=True):
    g = np.asarray(g, np.float64)
    if isinstance(spec, StackedStages):
      for index, stage in enumerate(spec):
        yield f"{jax.tree_util.keystr(path)}[{index}]", stage, g[index].ravel()
    else:
      yield jax.tree_util.keystr(path), spec, g.ravel()


def _shares(scaled_grads, exps, grads, all_doubled, specs) -> list[_Row]:
  """Every parameter's share through each boundary, measured by one run per boundary."""
  num_stages = len(exps)
  # d, the change when every scale doubles, is g itself but for values that rounded
  # differently near the subnormals. Measured against it, a parameter of stage s sees for
  # j >= s the very computation of its own stage that d saw: its own subnormals cancel.
  rows: list[_Row] = [
    (name, stage, g, g_all - g, [])
    for (name, stage, g), (*_, g_all) in zip(
      _rows_of(grads, specs), _rows_of(all_doubled, specs), strict=True
    )
  ]
  for j in range(num_stages - 1):
    doubled = scaled_grads(exps + (np.arange(num_stages) <= j))[0]
    for (*_, g, d, measured), (*_, g_j) in zip(rows, _rows_of(doubled, specs), strict=True):
      norm2 = np.vdot(d, d)
      measured.append(np.vdot(d, g_j - g) / norm2 if norm2 > 0 else 0.0)
  return rows


def _problems(rows: list[_Row], num_stages: int, tolerance: float) -> list[str]:
  """One description per row whose shares deviate from its stage's by more than ``tolerance``."""
  # Enough digits that a share beyond the tolerance never prints as its 0 or 1.
  digits = 17 if tolerance == 0 else min(17, max(4, 2 + math.ceil(-math.log10(tolerance))))
  problems = []
  for name, stage, _, d, share_list in rows:
    if not np.any(d):
      continue  # nothing to attribute (an unused parameter)
    shares = np.asarray(share_list)
    deviation = np.abs(shares - _one_stage_shares(stage, num_stages - 1))
    if np.max(deviation) <= tolerance:
      continue
    shown = ", ".join(f"{j}: {x:.{digits}g}" for j, x in enumerate(shares))
    fits = [
      k
      for k in range(num_stages)
      if np.all(np.abs(shares - _one_stage_shares(k, num_stages - 1)) <= tolerance)
    ]
    hint = f"; it behaves like stage {fits[0]}" if fits else ""
    worst = int(np.argmax(deviation))
    problems.append(
      f"  {name}, assigned to stage {stage}{hint}: {shown}\n"
      f"    largest deviation {deviation[worst]:.{digits}g} (at boundary {worst})"
    )
  return problems


def _stage_fit(grads, specs, boundary_amax, exps, target):
  """Per stage: the exponent that puts its largest boundary cotangent at most at ``target``
  (NaN when both its boundaries are zero), and whether its backward pass (its parameters'
  gradients and the cotangent it passes down) stayed finite, with the scales ``2**exps``."""
  finite = np.ones(len(exps), bool)
  for g, spec in zip(jax.tree.leaves(grads), specs, strict=True):
    g = np.asarray(g)
    if isinstance(spec, StackedStages):
      check_stacked(g.shape, spec)
      for stage, ok in zip(spec, np.isfinite(g.reshape(len(spec), -1)).all(axis=1), strict=True):
        finite[stage] &= ok
    else:
      finite[spec] &= np.isfinite(g).all()
  # Boundary k is observed at 2**exps[k+1], as the output of stage k+1's backward pass and
  # the input of stage k's (abs_max maps NaN to inf). Parameter gradients do not enter: those
  # of a tensor that bypasses boundaries mix two scales, which would feed back into the scales.
  b = np.asarray(boundary_amax, np.float64)
  finite[1:] &= np.isfinite(b)
  usable = np.isfinite(b) & (b > 0)
  # floor(log2(target / b)), exactly: frexp gives x = m 2^e with m in [0.5, 1).
  fits_b = np.where(usable, exps[1:] + np.frexp(target / np.where(usable, b, 1.0))[1] - 1, np.nan)
  fit = np.full(len(exps), np.nan)
  fit[:-1] = fits_b
  fit[1:] = np.fmin(fit[1:], fits_b)
  return fit, finite


def _next_exps(fit, finite, exps, ceiling) -> np.ndarray:
  """check_stages's next scales (as exponents), from the loss down.

  A stage takes its fit. inf/NaN flows backwards from where it started, the
  highest non-finite stage: its scale drops by 2^4 and stays at most there from
  then on (``ceiling``, updated in place), by 2^16 if no boundary gave it a
  fit. Any other stage without a fit (its boundary cotangents were zero or not
  finite) takes the scale of the stage above, so that the cotangent it
  receives arrives as it was.
  """
  culprit = np.flatnonzero(~finite).max() if not finite.all() else -1
  if culprit >= 0:
    ceiling[culprit] = min(ceiling[culprit], exps[culprit] - 4)
  new = exps.copy()
  for k in reversed(range(len(exps))):
    if not np.isnan(fit[k]):
      new[k] = fit[k]
    elif k == culprit:
      new[k] = exps[k] - 16
    elif k + 1 < len(exps):
      new[k] = new[k + 1]
    new[k] = min(new[k], ceiling[k])
    above = 0 if k + 1 == len(exps) else new[k + 1]
    new[k] = np.clip(new[k], above - _MAX_EXP, above + _MAX_EXP)
  return new


def _one_stage_shares(stage: int, num_boundaries: int) -> np.ndarray:
  return (np.arange(num_boundaries) >= stage).astype(np.float64)
