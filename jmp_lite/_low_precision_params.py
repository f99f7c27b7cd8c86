r"""16-bit parameters that keep small updates, as an Optax transformation.

:func:`low_precision_params` wraps any optimizer so that it trains parameters
stored in bf16 (or fp16) without an fp32 master copy. Each step it reads an
fp32 value :math:`m` of every 16-bit parameter :math:`p`, runs the inner
optimizer in fp32 on it, and stores :math:`m' = m + u` back in 16 bits by one
of four methods:

* ``nearest``: :math:`m = p`, :math:`p' = \mathrm{rn}(m')`, round to nearest:
  the baseline, which loses every update under half a unit in the last place;
* ``stochastic``: :math:`m = p`, :math:`p' = \mathrm{sr}(m')`, stochastic
  rounding (:func:`stochastic_round`): updates survive in expectation;
* ``kahan``: :math:`m = p + c`, :math:`p' = \mathrm{rn}(m')`,
  :math:`c' = \mathrm{rn}(m' - p')`: a 16-bit compensation :math:`c` holds
  what rounding lost and adds it back the next step (2 more bytes);
* ``split``: :math:`m = \mathrm{join}(p, l)`,
  :math:`(p', l') = \mathrm{split}(m')`: the bf16 parameter is the high half of
  an exact fp32 value whose low 16 bits :math:`l` the state keeps (2 more
  bytes, bf16 only).

The updates are :math:`p' - p` in fp32, which :func:`optax.apply_updates`
turns into exactly :math:`p'` (fp32 cannot express the step of a value that
shrinks over :math:`2^{16}`-fold at once; then what is kept is computed from
the value stored, and the split counts the element as inexact).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _rounding, _tree_util, _validation

# The public names; `jmp_lite` re-exports them.
__all__ = ["LowPrecisionParamsState", "low_precision_params", "master_params"]

METHODS = ("nearest", "stochastic", "kahan", "split")


class LowPrecisionParamsState(NamedTuple):
  """State of :func:`low_precision_params`.

  Attributes:
    inner_state: the wrapped optimizer's state (its floating arrays in
      ``state_dtype`` when one is given).
    steps: steps applied (int32); with ``key``, it picks a step's rounding.
    key: the key data of the PRNG key the rounding noise derives from.
    residual: per 16-bit parameter, Kahan's compensation (the parameter's
      dtype) or the split's low halves (int16); ``None`` for other methods
      and other parameters.
    rounded_away: how many 16-bit parameter elements the last step meant to
      change but left as they were (int32): updates lost to rounding.
    inexact: for ``split``, elements (over all steps) whose fp32 value could
      not be kept exactly, because fp32 updates cannot express their step: a
      value shrinking more than about :math:`2^{16}`-fold in one step (int32).
  """

  inner_state: optax.OptState
  steps: jax.Array
  key: jax.Array
  residual: Any
  rounded_away: jax.Array
  inexact: jax.Array


def _is_low(x: Any) -> bool:
  return _tree_util.is_float(x) and jnp.dtype(jnp.result_type(x)).itemsize < 4


def _wide(x: jax.Array) -> jax.Array:
  return x.astype(jnp.promote_types(x.dtype, jnp.float32)) if _tree_util.is_float(x) else x


def _is_stored_narrow(x: Any) -> bool:
  # The inner state's arrays (moments) are stored in `state_dtype`; scalars (counts, injected
  # hyperparameters) keep their own dtypes.
  return _tree_util.is_float(x) and jnp.ndim(x) > 0


def low_precision_params(
  inner: optax.GradientTransformation,
  method: str,
  *,
  seed: int | jax.Array = 0,
  state_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Wraps ``inner`` so that 16-bit parameters keep the updates it computes.

  For every bf16/fp16 parameter the inner optimizer sees an fp32 value (the
  parameter itself, plus what ``method`` keeps) and fp32 gradients; the result
  is stored back in 16 bits by ``method``. fp32 and
  other parameters are passed through to ``inner`` unchanged.

  Args:
    inner: the optimizer, e.g. ``optax.adamw(1e-3)`` or a chain.
    method: ``"nearest"`` (round to nearest: the baseline, which loses updates
      smaller than half a unit in the last place), ``"stochastic"``
      (stochastic rounding), ``"kahan"`` (a 16-bit compensation buffer) or
      ``"split"`` (the exact fp32 value as the bf16 parameter plus 16 low bits;
      bf16 parameters only).
    seed: the stochastic rounding's seed: an int, or a PRNG key (e.g.
      ``jax.random.key(0, impl="rbg")`` for another implementation). The noise
      of a step is a function of the seed, the step count and the leaf, so it
      is reproducible, resumes from a checkpoint and is the same on every
      replica of a parameter.
    state_dtype: the dtype to store the inner state's floating arrays in (e.g.
      ``jnp.bfloat16`` for Adam's moments), rounded by ``method``'s rounding
      (stochastically for ``"stochastic"``, else to nearest) and read in fp32;
      ``None`` keeps the dtypes ``inner.init`` gives for the fp32 values (fp32).

  Returns:
    A transformation whose ``update(grads, state, params, **extra_args)``
    requires ``params`` and returns updates that :func:`optax.apply_updates`
    adds to exactly the 16-bit values chosen. Use it as the whole optimizer
    (inside :func:`jmp_lite.loss_scaling`, which passes fp32 gradients): a
    transformation after it would change updates it has already rounded.

  On CPU, compile a step that donates this state with XLA's region-analysis copy
  insertion (docs/low-precision-params.md, "Step time").

  Example::

    params = jl.cast_to_half(params)  # bf16
    tx = jl.low_precision_params(optax.adam(1e-3), "stochastic", state_dtype=jnp.bfloat16)
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)  # still bf16
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  method = _validation.check_choice(method, "method", METHODS)
  if state_dtype is not None:
    state_dtype = _validation.check_dtype(
      state_dtype, "state_dtype", lambda d: d.itemsize <= 4, "a floating dtype of at most 32 bits"
    )
  key = _as_key(seed)
  impl = jax.random.key_impl(key)
  inner = optax.with_extra_args_support(inner)

  def init(params):
    _check_params(params, method)
    inner_state = inner.init(jax.tree.map(_wide, params))
    # The initial state is stored rounded to nearest: it is usually zeros (exact in any dtype),
    # and noise would only cost time.
    return LowPrecisionParamsState(
      inner_state=_store(inner_state, state_dtype, "nearest", None),
      steps=jnp.zeros((), jnp.int32),
      # A copy: a step that donates the state must not delete this transformation's key.
      key=_tree_util.copy_arrays(jax.random.key_data(key)),
      residual=_initial_residual(params, method),
      rounded_away=jnp.zeros((), jnp.int32),
      inexact=jnp.zeros((), jnp.int32),
    )

  def update(grads, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
        "low_precision_params needs the parameters: call update(grads, state, params)."
      )
    _check_params(params, method)
    values = _read(params, state.residual)
    inner_state = jax.tree.map(_wide, state.inner_state)
    updates, inner_state = inner.update(
      jax.tree.map(_wide, grads), inner_state, values, **extra_args
    )
    n_params = len(jax.tree.leaves(params))
    seeds = _seeds(state, impl, n_params + len(jax.tree.leaves(inner_state)))
    updates, residual, lost, inexact = _step_all(params, values, updates, method, seeds)
    return updates, LowPrecisionParamsState(
      inner_state=_store(inner_state, state_dtype, method, seeds[n_params:]),
      steps=optax.safe_increment(state.steps),
      key=state.key,
      residual=residual,
      rounded_away=lost,
      inexact=state.inexact + inexact,
    )

  return optax.GradientTransformationExtraArgs(init, update)


def _seeds(state: LowPrecisionParamsState, impl: Any, n: int) -> jax.Array:
  """``n`` uint32 seeds of the step's rounding, one per array, from one draw: XLA:CPU runs every
  Threefry call as a loop. Compiled away unless the method is stochastic."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state.key, impl=impl), state.steps)
  return jax.random.bits(key, (n,), jnp.uint32)


def _step_all(
  params: Any, values: Any, updates: Any, method: str, seeds: jax.Array
) -> tuple[Any, Any, jax.Array, jax.Array]:
  """Every parameter's :func:`_step`: updates, residual, elements rounded away, inexact."""
  p_leaves, treedef = jax.tree.flatten(params)
  stepped = [
    _step(p, m, u, method, seeds[i])
    for i, (p, m, u) in enumerate(
      zip(p_leaves, jax.tree.leaves(values), jax.tree.leaves(updates), strict=True)
    )
  ]
  residual = None
  if method in ("kahan", "split"):
    residual = jax.tree.unflatten(treedef, [s.residual for s in stepped])
  zero = jnp.zeros((), jnp.int32)
  return (
    jax.tree.unflatten(treedef, [s.update for s in stepped]),
    residual,
    sum((s.rounded_away for s in stepped), zero),
    sum((s.inexact for s in stepped), zero),
  )


def _as_key(seed: Any) -> jax.Array:
  if not isinstance(seed, jax.Array):
    return jax.random.key(_validation.check_int(seed, "seed", minimum=None))
  if not jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) or seed.shape:
    raise TypeError(f"seed must be an int or a single typed PRNG key, got {seed!r}.")
  return seed


def _store(tree: Any, state_dtype: Any, method: str, seeds: jax.Array | None) -> Any:
  """The inner state with its floating arrays in ``state_dtype``, rounded by ``method`` (a
  stochastic method takes one seed per leaf)."""
  if state_dtype is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
    treedef,
    [
      _round(x, state_dtype, None if seeds is None else seeds[i], method)
      if _is_stored_narrow(x)
      else x
      for i, x in enumerate(leaves)
    ],
  )


def _check_params(params: Any, method: str) -> None:
  if method != "split":
    return
  for path, p in jax.tree_util.tree_leaves_with_path(params):
    if _is_low(p) and jnp.result_type(p) != jnp.bfloat16:
      raise ValueError(
        f"method='split' keeps bf16 parameters (the high half of an fp32 value); the parameter "
        f"{jax.tree_util.keystr(path)} is {jnp.result_type(p).name}. Use 'kahan' or "
        "'stochastic' for fp16."
      )


def _round(x: jax.Array, dtype: Any, seed: jax.Array | None, method: str) -> jax.Array:
  # Only a narrower dtype rounds; state_dtype=float32 keeps fp32 moments as they are.
  if method == "stochastic" and jnp.dtype(dtype).itemsize < x.dtype.itemsize:
    assert seed is not None  # only init, which rounds to nearest, has no seeds
    return _rounding.stochastic_round_seeded(x, dtype, seed)
  return x.astype(dtype)


def _initial_residual(params: Any, method: str) -> Any:
  """Nothing lost yet: the parameters given are exact 16-bit values."""
  if method not in ("kahan", "split"):
    return None

  def zeros(p):
    if not _is_low(p):
      return None
    return jnp.zeros(p.shape, p.dtype if method == "kahan" else jnp.int16)

  return jax.tree.map(zeros, params)


def _read(params: Any, residual: Any) -> Any:
  """The fp32 values the inner optimizer sees: the 16-bit parameters and what they lost."""
  if residual is None:
    return jax.tree.map(_wide, params)

  def value(p, kept):
    if kept is None:
      return p
    if kept.dtype == jnp.int16:  # the split's low halves
      return _rounding.join_float32(p, kept)
    return p.astype(jnp.float32) + kept.astype(jnp.float32)  # Kahan's compensation

  return jax.tree.map(value, params, residual)


class _Stepped(NamedTuple):
  update: Any
  residual: Any
  rounded_away: jax.Array
  inexact: jax.Array


def _step(p: Any, value: Any, update: Any, method: str, seed: jax.Array) -> _Stepped:
  """One parameter's step: its 16-bit value, the update that reaches it, what is kept."""
  zero = jnp.zeros((), jnp.int32)
  if not _is_low(p):
    return _Stepped(update, None, zero, zero)
  target = value + update.astype(jnp.float32)
  if method == "split":
    chosen, _ = _rounding.split_float32(target)
  else:
    chosen = _round(target, p.dtype, seed, method)
  wide = p.astype(jnp.float32)
  # A value that stays takes a zero step (an infinite one must not get inf - inf = NaN), signed
  # as chosen so that -0.0 and +0.0 are stored as chosen (but +0.0 + -0.0 is +0.0).
  wide_chosen = chosen.astype(jnp.float32)
  step = jnp.where(chosen == p, jnp.copysign(0.0, wide_chosen), wide_chosen - wide)
  # What optax.apply_updates will store. It is `chosen` unless fp32 cannot express the step (a
  # value shrinking over 2^16-fold); what is kept is then computed from the value stored.
  stored = (wide + step).astype(p.dtype)
  # `chosen == p` exactly when `stored == p` (a step between two different values is never
  # lost whole), and it is known before the parameter's buffer is overwritten: comparing with
  # `stored` would make XLA keep a copy of every donated parameter.
  rounded_away = jnp.sum((chosen == p) & (update != 0), dtype=jnp.int32)
  kept, inexact = None, zero
  if method == "kahan":
    # An infinite value stored keeps no compensation (inf - inf would make it NaN).
    kept = jnp.where(jnp.isinf(stored), 0.0, target - stored.astype(jnp.float32)).astype(p.dtype)
  elif method == "split":
    high = jax.lax.bitcast_convert_type(stored, jnp.int16).astype(jnp.int32) << 16
    rest = jax.lax.bitcast_convert_type(target, jnp.int32) - high
    info = np.iinfo(np.int16)
    out_of_range = (rest < info.min) | (rest > info.max)
    # (A zero stored with the other sign is out of range too, but the same value.)
    inexact = jnp.sum(out_of_range & (target != stored), dtype=jnp.int32)
    # An inexpressible rest keeps the value stored: a clipped one could rebuild a NaN (-0.0).
    kept = jnp.where(out_of_range, 0, rest).astype(jnp.int16)
  return _Stepped(step, kept, rounded_away, inexact)


def master_params(params: Any, opt_state: Any) -> Any:
  """The fp32 values that :func:`low_precision_params` reads for ``params``.

  For ``"split"`` these are the exact fp32 parameters; for ``"kahan"`` the
  16-bit parameters plus their compensation; otherwise the parameters in fp32.

  Args:
    params: the parameters.
    opt_state: the optimizer state holding a :class:`LowPrecisionParamsState`
      (on its own or inside ``loss_scaling``, a chain...).

  Returns:
    ``params`` with every 16-bit floating leaf replaced by its fp32 value.

  Raises:
    ValueError: if ``opt_state`` holds no (or more than one) such state.
  """
  states = [
    x
    for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LowPrecisionParamsState))
    if isinstance(x, LowPrecisionParamsState)
  ]
  if len(states) != 1:
    raise ValueError(
      f"Found {len(states)} low_precision_params states in the optimizer state; expected one."
    )
  return _read(params, states[0].residual)
