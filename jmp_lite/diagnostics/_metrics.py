"""Diagnostics as metrics: flat scalars for a logger, computed every N steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite import _validation
from jmp_lite.diagnostics._gradient_stats import GradientStats

_METRIC_FIELDS = (
  "zero_fraction",
  "nonfinite_fraction",
  "underflow_fraction",
  "subnormal_fraction",
  "overflow_fraction",
  "max_abs",
)


def stats_to_metrics(stats: Mapping[str, GradientStats], prefix: str = "grads") -> dict[str, Any]:
  """Flattens gradient statistics to scalar metrics for a logger.

  Histograms are left out; log them separately if wanted.

  Args:
    stats: the output of :func:`gradient_statistics`.
    prefix: the first component of every metric name.

  Returns:
    ``{"<prefix>/<group>/<field>": value}`` for the fields ``zero_fraction``,
    ``nonfinite_fraction``, ``underflow_fraction``, ``subnormal_fraction``,
    ``overflow_fraction`` and ``max_abs`` of every group: scalar arrays.
  """
  return {
    f"{prefix}/{name}/{field}": getattr(s, field)
    for name, s in stats.items()
    for field in _METRIC_FIELDS
  }


def every_n_steps(step: Any, n: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """Runs ``fn(*args, **kwargs)`` on steps divisible by ``n``, zeros otherwise.

  Both cases go through one :func:`jax.lax.cond`, so only one branch runs;
  under ``vmap``, a ``cond`` on a batched predicate runs both, so call it
  outside ``vmap``.

  Args:
    step: the step number, an integer scalar (traced or not).
    n: the period, a Python int >= 1.
    fn: the function to run, e.g. :func:`gradient_statistics`.
    *args: positional arguments of ``fn``: its operands.
    **kwargs: keyword arguments of ``fn``: static configuration.

  Returns:
    ``fn(*args, **kwargs)`` where ``step % n == 0``, else a pytree of zeros of
    the same structure, shapes and dtypes.

  Raises:
    TypeError: if ``n`` is not an int, or ``step`` not an integer scalar.
    ValueError: if ``n < 1``.
  """
  n = _validation.check_int(n, "n", 1)
  step = jnp.asarray(step)
  if not jnp.issubdtype(step.dtype, jnp.integer) or step.shape != ():
    raise TypeError(f"step must be an integer scalar, got {step.dtype}{list(step.shape)}.")
  call = lambda a: fn(*a, **kwargs)
  shapes = jax.eval_shape(call, args)
  zeros = lambda a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return lax.cond(step % n == 0, call, zeros, args)
