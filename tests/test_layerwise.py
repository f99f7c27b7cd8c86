import functools
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl
from jmp_lite import layerwise

K = 5

# The tests check values, not speed: compiled with XLA's backend optimizations off (on 2 CPU
# cores compiling dominates their run time). Every compared pair compiles alike.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


# The random inputs are drawn by compiled functions: called eagerly, jax.random compiles its
# sampler at XLA's default optimization level, about a second for each new shape on 2 cores.
@functools.partial(jit, static_argnames=("seed", "width", "depth", "std"))
def _params(seed=0, width=16, depth=K, std=0.5):
  key = jax.random.PRNGKey(seed)
  return [
    {"w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) * std / np.sqrt(width)}
    for i in range(depth)
  ]


@functools.partial(jit, static_argnames=("seed", "width"))
def _batch(seed=1, width=16):
  key = jax.random.PRNGKey(seed)
  return jax.random.normal(key, (32, width)), jax.random.normal(jax.random.fold_in(key, 1), (32,))


def deep_tanh(params, x, y, dtype=jnp.float16, boundaries=True, offsets=None):
  """``offsets`` (one per boundary) are added where the boundaries are: a reference's handle
  on the cotangents there, with no layer-wise machinery."""
  h = x.astype(dtype)
  for k, layer in enumerate(params):
    h = jnp.tanh(h @ layer["w"].astype(dtype))
    if offsets is not None and k < len(params) - 1:
      h = h + offsets[k].astype(dtype)
    elif boundaries and k < len(params) - 1:
      h = jl.stage_boundary(h, k)
  pred = jnp.sum(h.astype(jnp.float32), axis=-1)
  return jnp.mean((pred - y) ** 2)


def residual_blocks(params, x, y, dtype=jnp.float16):
  h = x.astype(dtype)
  for k, block in enumerate(params):
    h = h + jnp.tanh(h @ block["w"].astype(dtype)) * 0.5  # branches merge inside the stage
    if k < len(params) - 1:
      h = jl.stage_boundary(h, k)
  return jnp.mean((jnp.sum(h.astype(jnp.float32), axis=-1) - y) ** 2)


# Module-level compiled functions, shared by the tests: each compiles once per function and
# per loss-scale configuration (the scales themselves are arguments, not constants).
deep_tanh_f32 = functools.partial(deep_tanh, dtype=jnp.float32, boundaries=False)
deep_tanh_staged_f32 = functools.partial(deep_tanh, dtype=jnp.float32)
residual_blocks_f32 = functools.partial(residual_blocks, dtype=jnp.float32)


@functools.partial(jit, static_argnums=0)
def layerwise_grads(fun, scale, *args):
  """``scale.value_and_grad(fun)(*args)``, compiled."""
  return scale.value_and_grad(fun)(*args)


@functools.partial(jit, static_argnums=0)
def reference_grads(fun, *args):
  """Plain ``jax.grad(fun)(*args)``, compiled."""
  return jax.grad(fun)(*args)


@jit
def unscale(scale, grads):
  return scale.unscale(grads)


@functools.partial(jit, static_argnums=0)
def boundary_cotangent_amax(fun, scale, params, x, y, offsets):
  """max |d(scale * fun)/dh| at each boundary, by differentiating zero ``offsets`` added there."""
  cotangents = jax.grad(lambda o: fun(params, x, y, offsets=o) * scale)(offsets)
  return jnp.stack([jnp.max(jnp.abs(c)) for c in cotangents])


def assert_bitwise_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _grads_with(scale, fun, params, x, y):
  return layerwise_grads(fun, scale, params, x, y)


def _unit_scales(num_stages=K):
  """A layer-wise scale whose stages all have scale 1: gradients and statistics in true units."""
  return jl.LayerwiseLossScale(list(range(num_stages))).with_scales(jnp.ones(num_stages))


def test_boundary_is_an_exact_identity_forward():
  x = jit(lambda: jax.random.normal(jax.random.PRNGKey(0), (4, 8)).astype(jnp.float16))()
  assert jl.stage_boundary(x, 0) is x  # no active context
  scale = jl.LayerwiseLossScale([0, 1])

  def fun(p, x):
    out = jl.stage_boundary(x * p, 0)
    return jnp.sum(out.astype(jnp.float32)), out

  (_, out), _ = jit(scale.value_and_grad(fun, has_aux=True))(jnp.float16(1), x)
  assert_bitwise_equal(out, x)


def test_equal_scales_give_plain_grad_bitwise():
  params = _params()
  x, y = _batch()
  s = 2.0**12
  scale = jl.LayerwiseLossScale([0, 1, 2, 3, 4]).with_scales([s] * K)
  loss, grads = _grads_with(scale, deep_tanh, params, x, y)
  ref_loss, ref = jit(jax.value_and_grad(lambda p: deep_tanh(p, x, y) * s))(params)
  assert_bitwise_equal(grads.grads, ref)
  assert np.float32(loss) * np.float32(s) == np.float32(ref_loss)
  assert_bitwise_equal(unscale(scale, grads), unscale(jl.StaticLossScale(s), ref))


def test_each_stage_is_unscaled_by_its_own_scale():
  params = _params(std=0.3)
  x, y = _batch()
  scale = jl.LayerwiseLossScale([0, 1, 2, 3, 4])
  scale = scale.with_scales(jnp.asarray([2.0**20, 2.0**17, 2.0**14, 2.0**11, 2.0**8], jnp.float32))
  _, grads = _grads_with(scale, deep_tanh, params, x, y)
  unscaled = unscale(scale, grads)
  # Layer k's raw scaled gradient carries S_k: its magnitude tracks the scale.
  ref32 = reference_grads(deep_tanh_f32, params, x, y)
  for k in range(K):
    g, r = np.asarray(unscaled[k]["w"]), np.asarray(ref32[k]["w"])
    np.testing.assert_allclose(g, r, rtol=0, atol=2e-2 * np.abs(r).max())
    ratio = np.abs(np.asarray(grads.grads[k]["w"])).max() / np.abs(r).max()
    assert 0.9 < ratio / float(scale.scales[k]) < 1.1


def test_residual_blocks_match_fp32():
  params = _params(std=0.4)
  x, y = _batch()
  scale = jl.LayerwiseLossScale([0, 1, 2, 3, 4])
  tx = jl.loss_scaling(optax.sgd(0.0), scale)
  state = tx.init(params)
  step = jit(lambda p, s: tx.update(jl.scaled_value_and_grad(residual_blocks, s)(p, x, y)[1], s, p))
  for _ in range(3):  # back off from the initial overflow, then refresh from statistics
    _, state = step(params, state)
  # At 2^15 stage 4 overflows, then stage 3 at 2^14: two skipped steps, then a refresh.
  assert int(state.skipped_steps) == 2
  # The refresh saw each stage's true maximum (fp32 reference, all scales 1: its parameter
  # gradients and the cotangents at its boundaries) and chose 2^floor(log2(65504 / 8 / max)).
  true_amax, ref32 = true_stage_amax(residual_blocks_f32, params, x, y)
  np.testing.assert_allclose(state.loss_scale.amax, true_amax, rtol=1e-2)
  np.testing.assert_array_equal(
    np.log2(state.loss_scale.scales), np.floor(np.log2(65504 / 8 / true_amax))
  )
  assert len(set(np.asarray(state.loss_scale.scales).tolist())) > 1  # layer-wise: not one scale
  _, grads = _grads_with(state.loss_scale, residual_blocks, params, x, y)
  unscaled = unscale(state.loss_scale, grads)
  for k in range(K):
    r = np.asarray(ref32[k]["w"])
    np.testing.assert_allclose(unscaled[k]["w"], r, rtol=0, atol=2e-2 * np.abs(r).max())


def test_boundary_statistics_match_numpy():
  # Two stages; the cotangent at the boundary is exactly c * S_1.
  c = np.asarray([0.0, 2.0**-20, -3 * 2.0**-12, 2.0**-3, 1.5, -(2.0**-30), 0.0, 5.0], np.float32)
  scale = jl.LayerwiseLossScale({"a": 0, "b": 1}, initial_scale=2.0**10, histograms=True)

  def fun(p, c):
    h = jl.stage_boundary(p["a"] * jnp.ones(c.shape, jnp.float32), 0)
    return jnp.sum(h * c) * p["b"]

  _, grads = jit(scale.value_and_grad(fun))({"a": 1.0, "b": 1.0}, jnp.asarray(c))
  observed = c * 2.0**10
  nonzero = np.abs(observed[observed != 0])
  expected_hist = np.zeros(layerwise.HIST_BINS)
  np.add.at(expected_hist, np.floor(np.log2(nonzero)).astype(int) - layerwise.HIST_MIN_EXP, 1)
  np.testing.assert_array_equal(grads.stats.amax, [np.abs(observed).max()])
  np.testing.assert_array_equal(grads.stats.histogram[0], expected_hist)
  # A wide random sample: at scales of 1 the cotangent at the boundary is the sample itself.
  v = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 2.0 ** np.arange(
    -40, 40, 0.08
  ).astype(np.float32)
  ref = np.bincount(
    np.clip(np.floor(np.log2(np.abs(v))).astype(int) - layerwise.HIST_MIN_EXP, 0, 127),
    minlength=layerwise.HIST_BINS,
  )
  wide = jl.LayerwiseLossScale({"a": 0, "b": 1}, initial_scale=1.0, histograms=True)
  _, grads = jit(wide.value_and_grad(fun))({"a": 1.0, "b": 1.0}, jnp.asarray(v))
  np.testing.assert_array_equal(grads.stats.histogram[0], ref)


def test_scale_rule_and_predicted_underflow():
  # One stage, one parameter: the gradient of sum(w * c) is c.
  c = np.asarray([3.0, 2.0**-40, 2.0**-20, 1.0], np.float32)
  scale = jl.LayerwiseLossScale({"w": 0}, initial_scale=1.0, margin_bits=1, histograms=True)
  tx = jl.loss_scaling(optax.sgd(0.0), scale)
  params = {"w": jnp.zeros(4)}

  @jit
  def step(state):
    _, grads = jl.scaled_value_and_grad(lambda p: jnp.sum(p["w"] * c), state)(params)
    return grads, tx.update(grads, state, params)[1]

  grads, state = step(tx.init(params))
  np.testing.assert_array_equal(grads.grads["w"], c)  # scaled by S = 1
  # amax 3: the largest 2^e with 3 * 2^e <= 65504 / 2 is 2^13.
  assert float(state.loss_scale.scales[0]) == 2.0**13
  assert float(state.loss_scale.amax[0]) == 3.0
  # At 2^13: 2^-40 * 2^13 = 2^-27 underflows (< 2^-25); 2^-20 * 2^13 does not.
  assert float(state.loss_scale.underflow[0]) == 0.25
  assert bool(state.loss_scale.underflow_exceeded[0])  # 25% > 1e-3: flagged


@pytest.fixture(scope="module")
def period_3_training():
  """(initial state, step(state, poisoned) -> (boundary maxima, next state), its traces).

  The gradients of the stages where ``poisoned`` (``bool[K]``) is True are made inf. The step
  appends to its traces (a list) each time it is traced.
  """
  params = _params()
  x, y = _batch()
  scale = jl.LayerwiseLossScale([0, 1, 2, 3, 4], initial_scale=2.0**10, update_period=3)
  tx = jl.loss_scaling(optax.sgd(0.0), scale)
  traces = []

  @jit
  def step(state, poisoned):
    traces.append(1)
    _, grads = jl.scaled_value_and_grad(deep_tanh, state)(params, x, y)
    bad = [{"w": jnp.where(poisoned[k], jnp.inf, g["w"])} for k, g in enumerate(grads.grads)]
    return grads.stats.amax, tx.update(grads._replace(grads=bad), state, params)[1]

  return tx.init(params), step, traces


def _stages(*indices):
  return np.isin(np.arange(K), indices)


def true_stage_amax(fun32, params, *args):
  """Each stage's largest true gradient: its parameters' and its boundaries' cotangents.

  From ``fun32`` (the model in fp32, with its boundaries) at scale 1 for every stage.
  """
  _, true = _grads_with(_unit_scales(), fun32, params, *args)
  b = np.asarray(true.stats.amax)
  params_amax = [max(np.abs(leaf).max() for leaf in jax.tree.leaves(g)) for g in true.grads]
  return np.max([params_amax, np.append(b, 0.0), np.insert(b, 0, 0.0)], axis=0), true.grads


def test_update_period_refreshes_only_every_n_finite_steps(period_3_training):
  state, step, traces = period_3_training
  history = []
  for poison in [False, False, False, False, True, False, False]:
    _, state = step(state, _stages(K - 1) if poison else _stages())
    history.append(np.log2(np.asarray(state.loss_scale.scales)).tolist())
  # Step 0 refreshes: each stage gets 2^floor(log2(65504 / 8 / its true maximum)).
  true_amax, _ = true_stage_amax(deep_tanh_staged_f32, _params(), *_batch())
  assert history[0] == np.floor(np.log2(65504 / 8 / true_amax)).tolist()
  assert history[1] == history[0] and history[2] == history[0]  # no refresh in between
  # Step 3 refreshes (statistics seen at better scales may move a stage by a bit).
  # Only the last stage's gradients were made non-finite: only it backs off, by
  # margin_bits (3): its gradients exceeded 65504 at its scale.
  assert history[4] == [*history[3][:-1], history[3][-1] - 3]
  assert history[5] == history[4]  # the skipped step did not count towards the period
  assert len(traces) == 1


def test_overflow_is_skipped_and_the_non_finite_stages_back_off():
  params = _params()
  x, y = _batch()
  scale = jl.LayerwiseLossScale([0, 1, 2, 3, 4], initial_scale=2.0**10)
  tx = jl.loss_scaling(optax.adam(1e-2), scale)
  state = tx.init(params)

  @jit
  def step(state):
    _, grads = jl.scaled_value_and_grad(deep_tanh, state)(params, x, y)
    # inf starting in stage 2 reaches stages 1 and 0 through the backward pass;
    # stages 3 and 4 (closer to the loss) stay finite and keep their scales.
    bad = [{"w": g["w"].at[0, 0].set(jnp.inf)} if k <= 2 else g for k, g in enumerate(grads.grads)]
    return tx.update(grads._replace(grads=bad), state, params)

  updates, new_state = step(state)
  assert not bool(new_state.last_finite) and int(new_state.skipped_steps) == 1
  assert all(np.all(np.asarray(u["w"]) == 0) for u in updates)
  assert_bitwise_equal(new_state.inner_state, state.inner_state)
  # Stage 2, where the inf started, exceeded 65504 at 2^10: it drops by margin_bits (3).
  # Stages 0 and 1 only received its inf and back off once.
  np.testing.assert_array_equal(np.log2(np.asarray(new_state.loss_scale.scales)), [9, 9, 7, 10, 10])


def test_between_refreshes_boundaries_are_not_observed_and_overflow_backs_off_above(
  period_3_training,
):
  # As if stage 3's backward pass overflowed in the cotangent it passes down.
  state, step, _ = period_3_training
  amax, state = step(state, _stages())  # a refresh step: the boundaries are observed
  # Every scale is 2^10, so the boundaries saw the cotangents of 2^10 * loss, as plain fp16
  # differentiation with respect to zero offsets at the boundaries does (to an fp16 rounding:
  # XLA may fuse the two programs differently).
  params, (x, y) = _params(), _batch()
  offsets = [jnp.zeros((x.shape[0], 16))] * (K - 1)
  expected = boundary_cotangent_amax(deep_tanh, jnp.float32(2.0**10), params, x, y, offsets)
  np.testing.assert_allclose(amax, expected, rtol=2.0**-10)
  before = np.log2(np.asarray(state.loss_scale.scales))
  amax, state = step(state, _stages(0, 1, 2))  # between refreshes: not observed
  np.testing.assert_array_equal(amax, np.zeros(K - 1))
  # Stage 2 (highest non-finite) drops by margin_bits; stage 3 above it, which
  # may be where the overflow started, and stages 0-1 below it back off once.
  np.testing.assert_array_equal(
    np.log2(np.asarray(state.loss_scale.scales)), before + np.asarray([-1, -1, -3, -1, 0])
  )


def _one_stage_steps(scale, gradients):
  """Feeds already-scaled gradients of one parameter; returns log2 scales after each step."""
  tx = jl.loss_scaling(optax.sgd(0.0), scale)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  traces = []

  @jit
  def update(g, s):
    traces.append(1)
    return tx.update({"w": g}, s, params)[1]

  out = []
  for g in gradients:
    state = update(jnp.asarray(g, jnp.float32), state)
    out.append(float(np.log2(state.loss_scale.scales[0])))
  assert len(traces) == 1
  return out, state


def test_scales_follow_the_largest_gradient_of_the_history():
  # Scale 1, so the true maxima are 4, 1, 1, 1; 65504 / 8 = 8188 = 2^12.999.
  scale = jl.LayerwiseLossScale({"w": 0}, initial_scale=1.0, amax_history_length=3)
  got, state = _one_stage_steps(scale, [[4.0, 0.0]] + [[1.0, 0.0]] * 3)
  # 4 is remembered for three steps (the scale also changes, so the gradients
  # fed as "scaled" by 1 mean smaller true values: 1 / 2^10, then 1 / 2^12).
  assert got[:3] == [10.0, 10.0, 10.0]
  assert got[3] == 22.0  # history (2^-10, 2^-10, 2^-10) -> 2^12.999 / 2^-10
  np.testing.assert_array_equal(state.loss_scale.amax_history[:, 0], [2.0**-10] * 3)
  assert float(state.loss_scale.amax[0]) == 2.0**-10
  one, _ = _one_stage_steps(
    jl.LayerwiseLossScale({"w": 0}, initial_scale=1.0, amax_history_length=1),
    [[4.0, 0.0], [1.0, 0.0]],
  )
  assert one == [10.0, 22.0]


def test_an_overflowing_stage_remembers_its_overflow():
  scale = jl.LayerwiseLossScale(
    {"w": 0}, initial_scale=2.0**10, amax_history_length=4, margin_bits=2
  )
  # Step 0 overflows at 2^10 (true max >= 65504 / 2^10 = 2^5.999): 2^10 -> 2^(10 - 2).
  # Steps 1-3 see 2^-4 at their scale (true 2^-12), but the overflow stays in
  # the 4-step history; step 4 forgets it.
  got, state = _one_stage_steps(scale, [[np.inf, 1.0]] + [[2.0**-4, 0.0]] * 4)
  assert got[:4] == [8.0, 8.0, 8.0, 8.0]
  assert got[4] == 25.0  # 65504 / 4 / 2^-12 = 2^25.999: the largest safe scale
  assert int(state.skipped_steps) == 1


@jax.custom_vjp
def _e5m2_cotangent(h):
  return h


_e5m2_cotangent.defvjp(
  lambda h: (h, None), lambda _, ct: (ct.astype(jnp.float8_e5m2).astype(ct.dtype),)
)


def test_fp8_e5m2_gradient_target():
  # The rule targets E5M2's max, 57344: 0.9375 * 2^13 = 7680 fits 65504 / 8 but not 57344 / 8.
  for dtype, expected in [("float16", 13.0), ("float8_e5m2", 12.0)]:
    scale = jl.LayerwiseLossScale({"w": 0}, initial_scale=1.0, gradient_dtype=dtype)
    assert _one_stage_steps(scale, [[0.9375, 0.0]])[0] == [expected]

  # Backward cotangents quantized to E5M2 (range 2^-16..57344) after every layer of a
  # network whose cotangents shrink 2^3 per layer: one scale loses the first layers.
  depth = 12
  params = _params(std=0.12, depth=depth)
  x, y = _batch()

  def model(p, x, y, fp8=True):
    h = x
    for k, layer in enumerate(p):
      h = jnp.tanh(h @ layer["w"])
      h = _e5m2_cotangent(h) if fp8 else h
      h = jl.stage_boundary(h, k) if k < depth - 1 else h
    return jnp.mean((jnp.sum(h, axis=-1) - y) ** 2)

  ref = jit(lambda *a: jax.grad(model)(*a, fp8=False))(params, x, y)

  def relative_errors(loss_scale):
    tx = jl.loss_scaling(optax.sgd(0.0), loss_scale)

    @jit
    def step(state):  # the next state, and the true gradients at this state's scales
      _, grads = jl.scaled_value_and_grad(model, state)(params, x, y)
      # a ScaledGrads, or a DynamicLossScale's bare gradients
      return tx.update(grads, state, params)[1], jl.get_loss_scale(state).unscale(grads)

    state = tx.init(params)
    for _ in range(3):  # settle the scales
      state, _ = step(state)
    assert int(state.skipped_steps) == 0
    _, got = step(state)
    return [
      float(np.linalg.norm(g["w"] - r["w"]) / np.linalg.norm(r["w"]))
      for g, r in zip(got, ref, strict=True)
    ]

  layerwise_errors = relative_errors(
    jl.LayerwiseLossScale(list(range(depth)), gradient_dtype="float8_e5m2")
  )
  dynamic_errors = relative_errors(jl.DynamicLossScale(jnp.float32(2.0**15)))
  assert dynamic_errors[:2] == [1.0, 1.0]  # all zero: below E5M2's range at the dynamic scale
  # E5M2 keeps 2 mantissa bits, and each layer adds its rounding: about 0.06-0.4 here.
  assert max(layerwise_errors) < 0.5


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nan_without_inf_is_detected(bad):
  # XLA:CPU's max may drop NaN; the per-stage check must not.
  scale = jl.LayerwiseLossScale({"w": 0}, initial_scale=2.0**10)
  got, state = _one_stage_steps(scale, [[bad, 1.0]])
  assert not bool(state.last_finite) and int(state.skipped_steps) == 1
  assert got == [7.0]  # down by margin_bits


def test_scanned_stack_with_traced_boundary_index():
  depth, width = 4, 8

  @jit
  def init(key):
    return {
      "stack": jax.random.normal(key, (depth, width, width)) * 0.4 / np.sqrt(width),
      "head": jax.random.normal(jax.random.fold_in(key, 1), (width,)),
    }

  params = init(jax.random.PRNGKey(3))
  x, y = _batch(width=width)

  def model(p, x, y, dtype=jnp.float16, offsets=None):
    def body(h, xs):
      w, i, offset = xs
      h = jnp.tanh(h @ w.astype(dtype))
      # The reference adds zero offsets where the boundaries are, to see their cotangents.
      return (jl.stage_boundary(h, i) if offsets is None else h + offset.astype(dtype)), None

    xs = (p["stack"], jnp.arange(depth), jnp.zeros(depth) if offsets is None else offsets)
    h, _ = jax.lax.scan(body, x.astype(dtype), xs)
    return jnp.mean(((h.astype(jnp.float32) @ p["head"]) - y) ** 2)

  stages = {"stack": layerwise.StackedStages(range(depth)), "head": depth}
  scale = jl.LayerwiseLossScale(stages)
  assert scale.num_stages == depth + 1
  scales = 2.0 ** np.asarray([18, 15, 12, 9, 6])
  scale = scale.with_scales(jnp.asarray(scales, jnp.float32))
  _, grads = jit(scale.value_and_grad(model))(params, x, y)
  assert not np.any(np.asarray(grads.stats.histogram))  # histograms are opt-in
  unscaled = unscale(scale, grads)
  ref_grad = jit(jax.grad(lambda p, o: model(p, x, y, jnp.float32, o), argnums=(0, 1)))
  ref, ref_cotangents = ref_grad(params, jnp.zeros((depth, x.shape[0], width)))
  for name in ("stack", "head"):
    r = np.asarray(ref[name])
    np.testing.assert_allclose(unscaled[name], r, rtol=0, atol=2e-2 * np.abs(r).max())
  # Boundary k (the traced index of the scan) saw its cotangent at stage k + 1's scale.
  np.testing.assert_allclose(
    grads.stats.amax,
    scales[1:] * np.abs(np.asarray(ref_cotangents)).max(axis=(1, 2)),
    rtol=1e-2,
  )


def test_trains_like_fp32_through_loss_scaling_traced_once():
  params = _params(std=1.0)
  x, y = _batch()

  def train(loss_scale, dtype):
    tx = jl.loss_scaling(optax.adam(3e-2), loss_scale)
    p, state = params, tx.init(params)
    traces = []

    @jit
    def step(p, state):
      traces.append(1)
      loss, grads = jl.scaled_value_and_grad(lambda q: deep_tanh(q, x, y, dtype), state)(p)
      updates, state = tx.update(grads, state, p)
      return optax.apply_updates(p, updates), state, loss

    losses = []
    for _ in range(25):
      p, state, loss = step(p, state)
      losses.append(float(loss))
    assert len(traces) == 1
    return np.asarray(losses), state

  ref, _ = train(jl.NoOpLossScale(), jnp.float32)
  losses, state = train(jl.LayerwiseLossScale([0, 1, 2, 3, 4], update_period=5), jnp.float16)
  assert int(state.skipped_steps) == 0
  assert ref[-1] < 0.5 * ref[0]
  # Within the noise of fp16 rounding in an Adam run at lr 3e-2.
  assert np.abs(losses - ref).max() < 0.03 * ref[0]


@pytest.fixture(scope="module")
def trained_state():
  """(params, state after one step) of a small layer-wise run, computed once for the module."""
  scale = jl.LayerwiseLossScale(
    {"a": 0, "b": layerwise.StackedStages([1, 2])}, update_period=7, min_loss_scale=[1.0, 2.0, 4.0]
  )
  tx = jl.loss_scaling(optax.sgd(1.0), scale)
  params = {"a": jnp.ones(2), "b": jnp.ones((2, 3))}

  @jit
  def step(state):
    loss = lambda p: jnp.sum(p["a"]) + 8 * jnp.sum(p["b"])
    _, grads = jl.scaled_value_and_grad(loss, state)(params)
    return tx.update(grads, state, params)[1]

  return params, step(tx.init(params))


@pytest.mark.parametrize("via", ["pickle", "orbax", "tree_map"])
def test_state_round_trips(via, tmp_path, trained_state):
  _, state = trained_state
  # The step moved the state off its initial values (what a round trip must keep).
  np.testing.assert_array_equal(state.loss_scale.steps_since_refresh, 0)
  np.testing.assert_array_equal(state.loss_scale.amax_history[0], [1.0, 8.0, 8.0])
  if via == "pickle":
    restored = pickle.loads(pickle.dumps(state))
  elif via == "tree_map":
    restored = jax.tree.map(lambda x: x, state)
  else:
    import orbax.checkpoint as ocp

    path = os.fspath(tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(path, state)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert_bitwise_equal(restored, state)
  assert restored.loss_scale.update_period == 7
  assert restored.loss_scale.min_loss_scale == (1.0, 2.0, 4.0)
  assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_adjust_without_statistics():
  scale = jl.LayerwiseLossScale([0, 1], initial_scale=8.0)
  np.testing.assert_array_equal(scale.adjust(jnp.array(False)).scales, [4.0, 4.0])
  np.testing.assert_array_equal(scale.adjust(jnp.array(True)).scales, [8.0, 8.0])
  assert float(scale.loss_scale) == 8.0
  assert float(scale.scale(jnp.float32(2.0))) == 16.0  # see test_bare_gradients_of_the_scaled...


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"param_stages": []}, ValueError, "empty"),
    ({"param_stages": [0, "1"]}, TypeError, "stage indices"),
    ({"param_stages": [0, True]}, TypeError, "stage indices"),
    ({"param_stages": [0, -1]}, ValueError, "outside"),
    ({"param_stages": [0, 3], "num_stages": 2}, ValueError, "outside"),
    ({"param_stages": [0], "update_period": 0}, ValueError, "update_period"),
    ({"param_stages": [0], "underflow_fraction": 0.0}, ValueError, "underflow_fraction"),
    ({"param_stages": [0], "gradient_dtype": "bfloat16"}, ValueError, "float16 or float8_e5m2"),
    ({"param_stages": [0], "initial_scale": -1.0}, ValueError, "initial_scale"),
    ({"param_stages": [0, 1], "min_loss_scale": [1.0, 2.0, 3.0]}, ValueError, "min_loss_scale"),
    ({"param_stages": [0], "min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError, "exceeds"),
    ({"param_stages": [0], "backoff_factor": 1}, ValueError, "backoff_factor"),
  ],
)
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    jl.LayerwiseLossScale(**kwargs)


def test_bad_usage_errors():
  scale = jl.LayerwiseLossScale([0, 1])
  stats = layerwise.BoundaryStats(jnp.zeros(1), jnp.zeros((1, layerwise.HIST_BINS)))
  with pytest.raises(ValueError, match="structure of the gradients"):
    scale.unscale(jl.ScaledGrads({"a": jnp.ones(2)}, stats))
  with pytest.raises(ValueError, match="out of range"):
    scale.value_and_grad(lambda p: jnp.sum(jl.stage_boundary(p[0], 1)))([jnp.ones(2)] * 2)
  with pytest.raises(TypeError, match="argnums"):
    scale.value_and_grad(lambda p: p, argnums=(0, 1))
  stacked = jl.LayerwiseLossScale({"s": layerwise.StackedStages([0, 1])})
  with pytest.raises(ValueError, match="leading axis"):
    stacked.unscale(jl.ScaledGrads({"s": jnp.ones((3, 2))}, stats))


def test_check_stages_accepts_correct_models():
  params = _params()
  x, y = _batch()
  scale = jl.LayerwiseLossScale([0, 1, 2, 3, 4])
  layerwise.check_stages(deep_tanh, scale, params, x, y)
  layerwise.check_stages(residual_blocks, scale, params, x, y)
  # A keyword that is not an array is a constant of a compilation of its own.
  layerwise.check_stages(deep_tanh, scale, params, x, y, dtype=jnp.bfloat16)
  # The loss is called once per trace of the compiled gradient that checks it.
  traces = []

  def counted(params, x, y):
    traces.append(1)
    return deep_tanh(params, x, y)

  layerwise.check_stages(counted, scale, params, x, y)
  assert len(traces) == 1
  # Unequal scales (ratios other than 1), passed through an optimizer state. The same loss
  # with array arguments of the same shapes: the first call's compiled gradient serves.
  state = jl.loss_scaling(optax.sgd(0.1), scale).init(params)
  uneven = scale.with_scales(jnp.asarray(2.0 ** np.asarray([14, 10, 12, 9, 8]), jnp.float32))
  layerwise.check_stages(counted, state._replace(loss_scale=uneven), params, x, y)
  assert len(traces) == 1


def test_check_stages_finds_wrong_stages_tied_weights_and_bypasses():
  params = _params()
  x, y = _batch()

  with pytest.raises(
    ValueError, match=r"\[2\]\['w'\], assigned to stage 3; it behaves like stage 2"
  ):
    layerwise.check_stages(deep_tanh, jl.LayerwiseLossScale([0, 1, 3, 3, 4]), params, x, y)

  def tied(p, x, y):  # layer 0's weights reused in stage 3
    h = x.astype(jnp.float16)
    for k in range(K):
      h = jnp.tanh(h @ p[0 if k == 3 else k]["w"].astype(jnp.float16))
      if k < K - 1:
        h = jl.stage_boundary(h, k)
    return jnp.mean((jnp.sum(h.astype(jnp.float32), axis=-1) - y) ** 2)

  # Enough digits to see the deviation, which is printed too (".3g" once showed 0.9996 as 1).
  with pytest.raises(
    ValueError,
    match=r"\[0\]\['w'\], assigned to stage 0: 0: 0\.\d{4,}, 1: 0\.\d{4,}, 2: 0\.\d{4,}, 3: 1\n"
    r"    largest deviation 0\.\d{4,} \(at boundary 0\)",
  ) as e:
    layerwise.check_stages(tied, jl.LayerwiseLossScale([0, 1, 2, 3, 4]), params, x, y)
  assert "[3]['w']" not in str(e.value)  # unused: a zero gradient is not reported

  def bypass(p, x, y):  # stage 0's output also feeds stage 3 directly
    h0 = jnp.tanh(x.astype(jnp.float16) @ p[0]["w"].astype(jnp.float16))
    h = jl.stage_boundary(h0, 0)
    for k in range(1, K):
      h = jnp.tanh(h @ p[k]["w"].astype(jnp.float16)) + (h0 if k == 3 else 0)
      if k < K - 1:
        h = jl.stage_boundary(h, k)
    return jnp.mean((jnp.sum(h.astype(jnp.float32), axis=-1) - y) ** 2)

  with pytest.raises(
    ValueError, match=r"\[0\]\['w'\], assigned to stage 0: 0: 0\.\d+, 1: 0\.\d+, 2: 0\.\d+, 3: 1\n"
  ):
    layerwise.check_stages(bypass, jl.LayerwiseLossScale([0, 1, 2, 3, 4]), params, x, y)


def test_check_stages_on_a_scanned_stack():
  depth, width = 3, 8
  init = jit(lambda key: jax.random.normal(key, (depth, width, width)) * 0.5 / np.sqrt(width))
  params = {"stack": init(jax.random.PRNGKey(0))}
  x, y = _batch(width=width)

  def model(p, x, y):
    def body(h, xs):
      w, i = xs
      return jl.stage_boundary(jnp.tanh(h @ w), i), None

    h, _ = jax.lax.scan(body, x, (p["stack"], jnp.arange(depth)))
    return jnp.mean((jnp.sum(h, -1) - y) ** 2)

  # The last boundary (index 2) leads to stage 3, which has no parameters.
  layerwise.check_stages(
    model,
    jl.LayerwiseLossScale({"stack": layerwise.StackedStages([0, 1, 2])}, num_stages=4),
    params,
    x,
    y,
  )
  with pytest.raises(
    ValueError, match=r"\['stack'\]\[1\], assigned to stage 2; it behaves like stage 1"
  ):
    layerwise.check_stages(
      model,
      jl.LayerwiseLossScale({"stack": layerwise.StackedStages([0, 2, 2])}, num_stages=4),
      params,
      x,
      y,
    )
  with pytest.raises(TypeError, match="LayerwiseLossScale"):
    layerwise.check_stages(model, jl.DynamicLossScale(2.0**15), params, x, y)


def deep_fp16_mlp(p, x, y):
  h = x.astype(jnp.float16)
  for k, layer in enumerate(p):
    h = jnp.tanh(h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16))
    if k < len(p) - 1:
      h = jl.stage_boundary(h, k)
  return jnp.mean((h.astype(jnp.float32) - y) ** 2)


def _deep_fp16_mlp(depth, seed=0):
  """A deep fp16 network: tanh layers of width 48, one stage per layer, fp16 compute.

  Its gradients shrink by about 2^-1.3 per layer, so at one scale for all stages
  the deep ones fall below fp16's normal range. The loss is a module-level function, so that
  check_stages compiles its gradient once for the tests that share it.
  """
  rng = np.random.default_rng(seed)
  width = 48
  params = [
    {
      "w": jnp.asarray(rng.normal(0, 0.6 / np.sqrt(width), (width, width)), jnp.float32),
      "b": jnp.asarray(rng.normal(0, 1, width), jnp.float32),
    }
    for _ in range(depth)
  ]
  x = jnp.asarray(rng.normal(size=(8, width)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(8, width)), jnp.float32)
  return deep_fp16_mlp, params, x, y


def test_check_stages_accepts_a_deep_fp16_mlp():
  # Measured by a JVP of the backward pass at the given scale (2^15), the shares of all 34
  # layers were off, by up to 1: underflow in the deep stages, and fp16 intermediates that
  # XLA rounds differently in the tangent and in the gradient.
  loss, params, x, y = _deep_fp16_mlp(34)
  # Now every share is exactly 0 or 1.
  layerwise.check_stages(loss, jl.LayerwiseLossScale(list(range(34))), params, x, y, tolerance=0)


def test_check_stages_names_only_a_wrong_index_in_a_deep_fp16_mlp():
  loss, params, x, y = _deep_fp16_mlp(34)
  stages = list(range(34))
  stages[9] = 10
  with pytest.raises(ValueError) as e:
    layerwise.check_stages(loss, jl.LayerwiseLossScale(stages), params, x, y)
  message = str(e.value)
  assert message.count("assigned to stage") == 2  # ['w'] and ['b'] of layer 9, nothing else
  # The shares are exact: 0 below boundary 9, 1 from it on.
  shares = ", ".join(f"{j}: {int(j >= 9)}" for j in range(33))
  for name in ("[9]['b']", "[9]['w']"):
    assert (
      f"\n  {name}, assigned to stage 10; it behaves like stage 9: {shares}\n"
      "    largest deviation 1 (at boundary 9)\n"
    ) in message
  assert "deviations up to 0.001 are accepted" in message


def test_check_stages_chooses_its_own_scales():
  params = _params()
  x, y = _batch()
  # Every gradient overflows at the given scales: the check lowers them and still finds
  # the wrong index (non-finite gradients were skipped, and nothing was reported).
  wrong = jl.LayerwiseLossScale([0, 1, 3, 3, 4]).with_scales([2.0**60] * 5)
  with pytest.raises(
    ValueError,
    match=r"\[2\]\['w'\], assigned to stage 3; it behaves like stage 2: 0: 0, 1: 0, 2: 1",
  ):
    layerwise.check_stages(deep_tanh, wrong, params, x, y)
  # A loss that is NaN at every scale cannot be checked: said, not passed.
  with pytest.raises(
    ValueError, match=r"needs finite gradients, but the backward pass of stages \[0, 1, 2, 3, 4\]"
  ):
    layerwise.check_stages(
      deep_tanh, jl.LayerwiseLossScale([0, 1, 2, 3, 4]), params, x, y * jnp.nan
    )
  with pytest.raises(ValueError, match=r"tolerance must be in \[0, 1\), got -0\.1"):
    layerwise.check_stages(
      deep_tanh, jl.LayerwiseLossScale([0, 1, 2, 3, 4]), params, x, y, tolerance=-0.1
    )


def test_bare_gradients_of_the_scaled_loss_carry_the_loss_scale_everywhere():
  # scale() multiplies by the last stage's scale; a plain jax.grad of it leaves the boundaries
  # inactive, so every gradient carries that one scale, and unscale and update take it so.
  scale = jl.LayerwiseLossScale({"a": 0, "b": 1}).with_scales([2.0**10, 2.0**4])
  fun = lambda p: jnp.sum(p["b"] * jl.stage_boundary(p["a"] * 3.0, 0))
  params = {"a": jnp.ones(2), "b": jnp.full(2, 2.0)}
  _, grads = jit(scale.value_and_grad(fun))(params)
  bare = jit(jax.grad(lambda p: scale.scale(fun(p))))(params)
  true = jit(jax.grad(fun))(params)
  np.testing.assert_array_equal(grads.grads["a"], true["a"] * 2.0**10)  # stage 0's own scale
  np.testing.assert_array_equal(bare["a"], true["a"] * 2.0**4)  # the loss's scale
  for unscaled in (unscale(scale, grads), unscale(scale, bare)):
    np.testing.assert_array_equal(unscaled["a"], true["a"])  # exact: powers of two
    np.testing.assert_array_equal(unscaled["b"], true["b"])
  # The update refuses them: without the boundary statistics no stage's scale can be updated.
  tx = jl.loss_scaling(optax.sgd(1.0), scale)
  state = tx.init(params)
  with pytest.raises(TypeError, match="with 2 stages got bare gradients"):
    tx.update(bare, state, params)
  updates, _ = tx.update(grads, state, params)
  np.testing.assert_array_equal(updates["a"], -true["a"])
  # One stage: the bare tree is that stage's gradients, at its scale.
  one = jl.LayerwiseLossScale({"a": 0, "b": 0}).with_scales([2.0**4])
  bare_one = jit(jax.grad(lambda p: one.scale(fun(p))))(params)
  unscaled, finite, _ = one.unscale_and_adjust(bare_one, params)
  assert bool(finite)
  np.testing.assert_array_equal(unscaled["a"], true["a"])
  # A kind with one scale refuses gradients at several: they are another loss scale's.
  with pytest.raises(TypeError, match="ScaledGrads with stats"):
    jl.StaticLossScale(2.0**4).unscale_and_adjust(grads, params)


def test_configuration_is_a_dataclass_with_the_users_param_stages():
  stages = {"enc": {"w": 0}, "dec": {"w": 1, "stack": layerwise.StackedStages([1, 2])}}
  scale = jl.LayerwiseLossScale(stages, initial_scale=[2.0**12, 2.0**8, 2.0**4])
  assert scale.param_stages == stages
  assert "param_stages={'dec': {'stack': (1, 2), 'w': 1}, 'enc': {'w': 0}}" in repr(scale)
  assert "PyTreeDef" not in repr(scale)
  np.testing.assert_array_equal(scale.scales, [2.0**12, 2.0**8, 2.0**4])
  trained = scale.with_scales([2.0**10, 2.0**6, 2.0**3])
  replaced = trained.replace(update_period=4)
  assert replaced.update_period == 4 and replaced.param_stages == stages
  np.testing.assert_array_equal(replaced.scales, trained.scales)  # the state is kept
  with pytest.raises(ValueError, match="amax_history must have shape"):
    trained.replace(amax_history_length=3)
  # Through jit and tree_map, unchanged.
  back = jit(lambda s: s)(scale)
  assert back.param_stages == stages and back.initial_scale == scale.initial_scale
  with pytest.raises(ValueError, match="initial_scale"):
    jl.LayerwiseLossScale(stages, initial_scale=[1.0, 2.0])
  with pytest.raises(ValueError, match="one value per stage"):
    scale.with_scales([1.0, 2.0])
  with pytest.raises(ValueError, match="within"):
    scale.with_scales([1.0, 2.0, 0.5])


def test_fp8_refuses_a_layerwise_loss_scale():
  scale = jl.LayerwiseLossScale([0, 1])
  state = jl.fp8.init_dot_state()
  with pytest.raises(TypeError, match="each stage its own"):
    jl.fp8.dot_general(
      jnp.ones((2, 4)), jnp.ones((4, 3)), (((1,), (0,)), ((), ())), state, loss_scale=scale
    )
  with pytest.raises(TypeError, match="each stage its own"):
    jl.diagnostics.gradient_statistics({"w": jnp.ones(2)}, loss_scale=scale)


def test_non_float_leaves_are_named_by_the_users_argument_names():
  # jax.value_and_grad of an Equinox module (functions as leaves) with a layer-wise scale: the
  # probes travel with the module or come last, but the error names the user's arguments.
  import equinox as eqx

  model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (6, 4))
  loss_fn = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
  not_float = (
    "these leaves are not: model.activation: a function (custom_jvp); "
    "model.final_activation: a function. For an Equinox module"
  )
  for argnums, which in [(None, "the first argument"), (0, "argnums=0")]:
    selection = {} if argnums is None else {"argnums": argnums}
    scaled = jl.scaled_value_and_grad(loss_fn, jl.LayerwiseLossScale(0), **selection)
    with pytest.raises(TypeError) as info:
      scaled(model, x)
    assert f"differentiates every leaf of {which}," in str(info.value)
    assert not_float in str(info.value)
