"""The per-backend finiteness rules (jmp_lite/_finite.py), each against numpy's isfinite.

Both rules run here on XLA:CPU: ``all_finite_rule`` takes the platform by name, and the
``rule`` helper swaps the dispatcher for one rule so that the public paths (``jl.all_finite``,
the loss scales' ``unscale_and_adjust``) are checked under each. Every jitted function is a
fresh lambda: jit's trace cache is keyed on the function, and a cached trace would keep the
rule it was traced with.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jmp_lite as jl
from jmp_lite import _finite

RULES = ["cpu", "cuda", "tpu"]  # "rocm" takes the "cuda" rule, any other platform the "tpu" one
FLOATS = [np.float32, np.float16, ml_dtypes.bfloat16]


@contextlib.contextmanager
def rule(platform):
  """Makes jmp_lite use ``platform``'s rule whatever the backend."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_finite, "all_finite", functools.partial(_finite.all_finite_rule, platform))
    yield


def reference(leaves) -> bool:
  """numpy's answer over the inexact leaves (each widened exactly to float64)."""
  return all(
    bool(np.isfinite(np.asarray(x).astype(np.float64)).all())
    for x in leaves
    if np.issubdtype(np.asarray(x).dtype, np.inexact) or np.asarray(x).dtype == ml_dtypes.bfloat16
  )


@st.composite
def trees(draw, *, min_size=0, max_size=4, allow_int=True):
  """Lists of leaves of mostly huge finite values (so that sums overflow), with at most one
  inf, -inf or NaN in half of them."""
  tree = []
  for _ in range(draw(st.integers(min_size, max_size))):
    dtype = draw(st.sampled_from(FLOATS + ([np.int32] if allow_int else [])))
    shape = draw(st.sampled_from([(), (1,), (5,), (3, 4)]))
    if dtype is np.int32:
      tree.append(draw(hnp.arrays(np.int32, shape)))
      continue
    big = float(jnp.finfo(dtype).max)
    values = st.sampled_from([0.0, 1.0, -2.5, min(7e4, big), big / 2, -big, *[big] * 4])
    tree.append(draw(hnp.arrays(np.float32, shape, elements=values)).astype(dtype))
  floating = [x for x in tree if x.dtype != np.int32 and x.size]
  if floating and draw(st.booleans()):
    leaf = draw(st.sampled_from(floating))
    leaf.flat[draw(st.integers(0, leaf.size - 1))] = draw(
      st.sampled_from([np.inf, -np.inf, np.nan])
    )
  return tree


def uses_conditional(fun, *args) -> bool:
  return "cond[" in str(jax.make_jaxpr(fun)(*args))


# The rules themselves -----------------------------------------------------------------------


@pytest.mark.parametrize("platform", RULES)
@settings(max_examples=15)
@given(tree=trees())
def test_rule_matches_numpy(platform, tree):
  values = [jnp.asarray(x) for x in tree if not np.issubdtype(x.dtype, np.integer)]
  if not values:
    return  # the rules take non-empty lists; the empty tree is jl.all_finite's (below)
  out = jax.jit(lambda v: _finite.all_finite_rule(platform, lambda: v))(values)
  assert out.dtype == jnp.bool_ and out.shape == ()
  assert bool(out) == reference(tree)


@pytest.mark.parametrize("platform", RULES)
def test_rule_is_exact_when_a_sum_of_finite_values_overflows(platform):
  big32 = float(np.finfo(np.float32).max)
  big16 = float(np.finfo(np.float16).max)
  check = jax.jit(lambda v: _finite.all_finite_rule(platform, lambda: v))
  assert bool(check([jnp.full(4, big32), jnp.full(3, big32)]))  # the sum is inf
  assert bool(check([jnp.full(4, big32), jnp.full(3, -big32), jnp.float32(-big32)]))
  assert bool(check([jnp.full(1000, big16, jnp.float16)]))  # inf in an fp16 sum
  assert bool(check([jnp.full(8, float(jnp.finfo(jnp.bfloat16).max), jnp.bfloat16)]))
  assert not bool(check([jnp.full(4, big32), jnp.asarray([1.0, jnp.nan])]))
  assert not bool(check([jnp.full(4, big32), jnp.asarray([jnp.inf, -jnp.inf])]))


def test_cpu_rule_sums_proxies_only_while_they_vouch_for_the_values():
  """The CPU rule believes a finite sum of the proxies only where ``proxies_valid``."""
  values = [jnp.asarray([1.0, jnp.inf])]
  check = jax.jit(lambda p, ok: _finite.all_finite_rule("cpu", lambda: values, p, ok))
  finite_proxy = [jnp.ones(2)]
  assert not bool(check(finite_proxy, jnp.asarray(False)))  # falls back to the values
  assert bool(check(finite_proxy, jnp.asarray(True)))  # a proxy that lies is believed
  assert not bool(check([jnp.asarray([jnp.nan, 0.0])], jnp.asarray(True)))


def test_only_the_cpu_rule_has_a_conditional():
  values = [jnp.ones(3), jnp.ones((2, 2), jnp.float16)]
  assert uses_conditional(lambda v: _finite.all_finite_rule("cpu", lambda: v), values)
  for platform in ("cuda", "rocm", "tpu"):
    assert not uses_conditional(lambda v, p=platform: _finite.all_finite_rule(p, lambda: v), values)


# Dispatch: the rule of the platform the step is lowered for -----------------------------


def _lowered_text(fun, args, platform):
  return jax.jit(fun).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(("platform", "reductions"), [("cuda", 2), ("rocm", 2), ("tpu", 7)])
def test_accelerator_rules_reduce_per_shape_on_gpu_per_leaf_on_tpu(platform, reductions):
  """On a GPU same-shaped leaves share one variadic reduction (scalars need none); on a TPU
  every leaf has its own. A NaN or inf in any leaf is found either way."""
  shapes = [(4, 3), (4, 3), (3,), (3,), (3,), (), ()]
  dtypes = [
    jnp.float32,
    jnp.float16,
    jnp.float32,
    jnp.float32,
    jnp.bfloat16,
    jnp.float32,
    jnp.float16,
  ]
  leaves = [jnp.ones(s, d) for s, d in zip(shapes, dtypes, strict=True)]
  check = lambda v: _finite.all_finite_rule(platform, lambda: v)
  assert _lowered_text(check, (leaves,), platform).count("stablehlo.reduce") == reductions
  assert bool(jax.jit(check)(leaves))
  for i, bad in enumerate([jnp.nan, jnp.inf, -jnp.inf, jnp.nan, jnp.inf, jnp.nan, -jnp.inf]):
    poisoned = list(leaves)
    poisoned[i] = leaves[i].at[(0,) * leaves[i].ndim].set(bad)
    assert not bool(jax.jit(check)(poisoned)), i


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_lowering_keeps_only_the_platform_rule(platform):
  grads = {"w": jnp.ones((4, 3)), "b": jnp.ones(3, jnp.float16)}
  text = _lowered_text(lambda g: jl.all_finite(g), (grads,), platform)
  sums = text.count("applies stablehlo.add")
  ands = text.count("applies stablehlo.and")
  # cpu: one sum per leaf, and the exact fallback's and-reductions; elsewhere only the latter.
  assert (sums, ands) == ((2, 2) if platform == "cpu" else (0, 2))


def test_compiled_cpu_step_has_only_the_fallback_conditional():
  """The platform choice leaves no conditional behind; the fallback is the one left."""
  tx = jl.loss_scaling(optax.adam(1e-3), jl.DynamicLossScale(2.0**15))
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  state = tx.init(params)
  text = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  assert text.count(" conditional(") == 1


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerator_step_lowers_without_a_sum(platform):
  """On GPU/TPU the loss-scaling update lowers to and-reductions only: no sum, no fallback."""
  tx = jl.loss_scaling(optax.adam(1e-3), jl.DynamicLossScale(2.0**15))
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  text = _lowered_text(tx.update, (params, tx.init(params), params), platform)
  assert text.count("applies stablehlo.add") == 0  # adam's own reductions are none here
  assert text.count("applies stablehlo.and") == 2


# The public paths, under each rule ------------------------------------------------------


@pytest.mark.parametrize("platform", RULES)
@settings(max_examples=12)
@given(tree=trees())
def test_all_finite_matches_numpy(platform, tree):
  with rule(platform):
    out = jax.jit(lambda t: jl.all_finite(t))([jnp.asarray(x) for x in tree])
  assert bool(out) == reference(tree)


@pytest.mark.parametrize("platform", RULES)
def test_all_finite_of_empty_and_integer_trees(platform):
  with rule(platform):
    assert bool(jax.jit(lambda t: jl.all_finite(t))({}))
    assert bool(jax.jit(lambda t: jl.all_finite(t))([None, jnp.arange(3)]))


SCALES = [
  jl.NoOpLossScale(),
  jl.StaticLossScale(0.25),  # 1/S = 4 > 1: a finite scaled gradient can overflow
  jl.StaticLossScale(1.0),
  jl.DynamicLossScale(2.0**15),
  jl.DynamicLossScale(jnp.float16(0.5), min_loss_scale=0.25),
]


def _unscaled_reference(scaled, loss_scale, param_dtype):
  """numpy's unscale: widen to fp32, multiply by 1/S in fp32, widen to the parameter dtype."""
  wide = np.asarray(scaled).astype(np.promote_types(np.asarray(scaled).dtype, np.float32))
  inverse = np.float32(1) / np.float32(np.asarray(loss_scale.loss_scale, np.float32))
  with np.errstate(over="ignore", invalid="ignore"):
    grad = wide * inverse.astype(wide.dtype)
    return grad if param_dtype is None else grad.astype(jnp.promote_types(grad.dtype, param_dtype))


@pytest.mark.parametrize("platform", RULES)
@settings(max_examples=15)
@given(
  scaled=trees(min_size=1, max_size=3, allow_int=False),
  scale_index=st.integers(0, len(SCALES) - 1),
  param_dtypes=st.one_of(st.none(), st.lists(st.sampled_from(FLOATS), min_size=3, max_size=3)),
)
def test_unscale_and_adjust_finiteness_matches_numpy(platform, scaled, scale_index, param_dtypes):
  """Exact for every kind of scale, 1/S above and below 1, and narrowing parameter dtypes."""
  loss_scale = SCALES[scale_index]
  dtypes = [None] * len(scaled) if param_dtypes is None else param_dtypes[: len(scaled)]
  pairs = list(zip(scaled, dtypes, strict=True))
  params = None if param_dtypes is None else [np.zeros(x.shape, d) for x, d in pairs]
  expected = [_unscaled_reference(x, loss_scale, d) for x, d in pairs]
  with rule(platform):
    grads, finite, next_scale = jax.jit(lambda s, g, p: s.unscale_and_adjust(g, p))(
      loss_scale, [jnp.asarray(x) for x in scaled], params
    )
  assert bool(finite) == reference(expected)
  for grad, want in zip(grads, expected, strict=True):  # the check judged these gradients
    np.testing.assert_array_equal(np.isfinite(np.asarray(grad, np.float64)), np.isfinite(want))
  assert float(next_scale.loss_scale) == float(loss_scale.adjust(jnp.asarray(finite)).loss_scale)


@pytest.mark.parametrize("platform", RULES)
@pytest.mark.parametrize(
  ("param_dtype", "value"),
  [(np.float16, 65520.0), (ml_dtypes.bfloat16, float(np.finfo(np.float32).max))],
)
def test_unscale_and_adjust_gives_16_bit_params_fp32_gradients_beyond_their_range(
  platform, param_dtype, value
):
  """A finite fp32 gradient beyond the parameter format's range stays finite and exact: the
  update is computed in fp32 (jl.low_precision_params stores it in 16 bits)."""
  params = [np.zeros(2, param_dtype)]
  for loss_scale in (jl.NoOpLossScale(), jl.StaticLossScale(1.0)):
    with rule(platform):
      grads, finite, _ = jax.jit(lambda s, g, p: s.unscale_and_adjust(g, p))(
        loss_scale, [jnp.asarray([value, 1.0], jnp.float32)], params
      )
    assert grads[0].dtype == jnp.float32 and grads[0].tolist() == [value, 1.0]
    assert bool(finite)


@pytest.mark.parametrize("platform", RULES)
def test_loss_scaling_skips_under_each_rule(platform):
  """A scaled gradient that only overflows once unscaled (S < 1) is skipped; a big finite one
  that overflows the sum is applied."""
  params = {"w": jnp.zeros(3)}
  big = float(np.finfo(np.float32).max)
  for loss_scale, g, applied in [
    (jl.StaticLossScale(0.5), [big, 0.0, 0.0], False),
    (jl.StaticLossScale(1.0), [big, big, 0.0], True),
    (jl.DynamicLossScale(2.0**4), [1.0, jnp.nan, 0.0], False),
  ]:
    tx = jl.loss_scaling(optax.sgd(1.0), loss_scale)
    with rule(platform):
      _, state = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))(
        {"w": jnp.asarray(g)}, tx.init(params), params
      )
    assert bool(state.last_finite) == applied and int(state.skipped_steps) == (not applied)


def test_loss_scaling_step_makes_no_pass_beyond_the_keep_state_floor():
  """The compiled CPU step of ``jl.loss_scaling`` reads and writes the weight-sized arrays
  (weights, gradients, Adam's moments) exactly as often as a bare step that checks
  ``jl.all_finite`` and keeps its state on a skip, and less often than Flax's DynamicScale:
  the unscaled gradients are never written out for the check."""
  from benchmarks import overhead

  widths = [64, 64, 64, 10]
  params = overhead.init_mlp(jax.random.PRNGKey(0), widths)
  x, y = jnp.ones((8, 64)), jnp.zeros((8,), jnp.int32)
  variants = overhead.make_variants(optax.adam(1e-3))
  passes = {}
  for name in ("plain", "check_keep_state", "jmp_lite", "flax_dynamic_scale"):
    init, step = variants[name]
    text = jax.jit(step).lower(params, init(params), x, y).compile().as_text()
    passes[name] = overhead.weight_passes(text, "f32[64,64]")
  assert passes["jmp_lite"] == passes["check_keep_state"]
  assert passes["jmp_lite"]["writes"] == passes["plain"]["writes"]
  assert passes["jmp_lite"]["reads"] < passes["flax_dynamic_scale"]["reads"]
  assert passes["jmp_lite"]["writes"] < passes["flax_dynamic_scale"]["writes"]
