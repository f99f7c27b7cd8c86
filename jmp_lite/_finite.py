"""Exact finiteness checks, in the cheapest form for each backend (private).

Every rule here is exact: any inf, -inf or NaN gives False, and finite values
give True, whatever their magnitude. The backends differ in what is cheap:

* **XLA:CPU** (``"cpu"``): a float sum of an array is a plain vectorised
  reduction, while ``all(isfinite(x))`` materialises a boolean per element
  (3-5x dearer; docs/benchmarks.md). inf, -inf and NaN all make a sum
  non-finite, but finite values can overflow it, so a non-finite sum falls
  back to the elementwise check under a ``lax.cond``, taken only on such
  steps. XLA:CPU runs a conditional on the thread that runs the program, so
  reading its predicate costs nothing. The sum reads the arrays as they are:
  XLA:CPU turns ``sum(x * c)`` into a broadcast of ``c`` the size of ``x``
  plus the reduction (2.7x the cost of ``sum(x)``), so the loss scales sum the
  scaled gradients, which vouch for the unscaled ones (``proxies`` below).
* **XLA:GPU, XLA:TPU**: ``all(isfinite(x))`` is a reduction that reads each
  value once, with what produces ``x`` (the unscale multiply, a cast) fused
  into it: as cheap as a sum, and exact with no fallback. A ``lax.cond`` would
  cost more than the check: XLA:GPU chooses a conditional's branch on the
  host, so every step would copy the predicate back and wait for the stream,
  and every kernel after it (the whole optimizer update) would be launched
  late.
* **XLA:GPU** (``"cuda"``, ``"rocm"``) launches a kernel per reduction, and
  neither merges sibling reductions nor keeps one reduction over a
  concatenation (it splits ``reduce(concatenate)`` back into one reduction
  per operand). So the arrays of one shape are reduced together, by one
  variadic reduction: a model's gradients cost a kernel per distinct leaf
  shape, not one per leaf. Arrays of one shape share a sharding in the usual
  layouts, so the SPMD partitioner moves no array for it.
* **XLA:TPU** (any other platform) runs the whole step as one program, with no
  launch to save, and moves more bytes for the variadic form, so each array
  has its own reduction there (docs/benchmarks.md, "Loss scaling").

The rule is chosen when the step is lowered, for the platform it is lowered
for (:func:`jax.lax.platform_dependent`), not from the default backend: the
compiled program contains only the chosen rule, and no conditional for the
choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def is_inexact(x) -> bool:
  """Whether ``x`` is floating or complex.

  Args:
    x: an array, a scalar or a dtype.

  Returns:
    True for a floating or complex dtype, False for integers, booleans and
    ``float0``.
  """
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def inexact_leaves(tree) -> list[jax.Array]:
  """The leaves of ``tree`` a finiteness check reads.

  Args:
    tree: a pytree.

  Returns:
    Its floating (and complex) leaves in tree order; integers and ``float0``
    are skipped.
  """
  return [x for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]


def _and_each(flags: tuple[jax.Array, ...], more: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  return tuple(a & b for a, b in zip(flags, more, strict=True))


def _every_isfinite(values: Sequence[jax.Array]) -> jax.Array:
  return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in values])


def _every_isfinite_by_shape(values: Sequence[jax.Array]) -> jax.Array:
  by_shape: dict[tuple[int, ...], list[jax.Array]] = {}
  for x in values:
    by_shape.setdefault(x.shape, []).append(jnp.isfinite(x))
  flags = []
  for shape, finite in by_shape.items():
    if not shape:  # scalars need no reduction
      flags.extend(finite)
      continue
    every = (jnp.array(True),) * len(finite)
    flags.extend(lax.reduce(tuple(finite), every, _and_each, tuple(range(len(shape)))))
  return functools.reduce(jnp.logical_and, flags)


def _sum_then_check(
  values: Callable[[], Sequence[jax.Array]],
  proxies: Sequence[jax.Array],
  proxies_valid: jax.typing.ArrayLike,
) -> jax.Array:
  total = sum(jnp.sum(x, dtype=jnp.promote_types(jnp.result_type(x), jnp.float32)) for x in proxies)
  fast = jnp.isfinite(total) & proxies_valid
  # The exact check runs only when the sum could not vouch for the values.
  # ``values`` is traced inside the branch, so what it computes from the
  # proxies (an unscale) is not materialised for the conditional's operands.
  return lax.cond(
    fast,
    lambda: fast,  # (not a constant True: it keeps shard_map's varying type)
    lambda: _every_isfinite(values()),
  )


def all_finite_rule(
  platform: str,
  values: Callable[[], Sequence[jax.Array]],
  proxies: Sequence[jax.Array] | None = None,
  proxies_valid: jax.typing.ArrayLike = True,
) -> jax.Array:
  """Whether every element of ``values()`` is finite, by ``platform``'s rule.

  Args:
    platform: ``"cpu"`` for XLA:CPU's rule (sum, then the elementwise check
      only if the sum is not finite); ``"cuda"`` or ``"rocm"`` for XLA:GPU's
      (one ``all(isfinite)`` reduction per distinct shape); any other name for
      XLA:TPU's (one ``all(isfinite)`` reduction per array).
    values: traces the (non-empty) inexact arrays to check.
    proxies: arrays the CPU rule sums instead of ``values()`` (default: the
      values): the values before a map that keeps finite values finite
      whenever ``proxies_valid`` holds, e.g. scaled gradients before
      multiplying by ``1/S <= 1``. Summing them spares XLA:CPU the map; the
      other rule ignores them.
    proxies_valid: a bool scalar; where False the CPU rule checks the values
      elementwise.

  Returns:
    A bool scalar, exact on every platform.
  """
  if platform in ("cuda", "rocm"):
    return _every_isfinite_by_shape(values())
  if platform != "cpu":
    return _every_isfinite(values())
  return _sum_then_check(values, values() if proxies is None else proxies, proxies_valid)


def all_finite(
  values: Callable[[], Sequence[jax.Array]],
  proxies: Sequence[jax.Array] | None = None,
  proxies_valid: jax.typing.ArrayLike = True,
) -> jax.Array:
  """Whether every element of ``values()`` is finite, by the rule of the platform lowered for.

  Args:
    values: traces the (non-empty) inexact arrays to check.
    proxies: arrays the CPU rule sums instead (see :func:`all_finite_rule`).
    proxies_valid: a bool scalar; where False the CPU rule checks the values
      elementwise.

  Returns:
    A bool scalar, exact on every platform; the compiled program holds only
    the rule of the platform it was lowered for.
  """
  rule = lambda platform: functools.partial(
    all_finite_rule, platform, values, proxies, proxies_valid
  )
  return lax.platform_dependent(
    cpu=rule("cpu"), cuda=rule("cuda"), rocm=rule("rocm"), default=rule("default")
  )
