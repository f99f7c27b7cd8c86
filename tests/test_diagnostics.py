"""Gradient statistics, loss-scale health and culprit naming."""

import functools
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

import jmp_lite as jl
from jmp_lite import _jaxpr
from jmp_lite import diagnostics as diag
from jmp_lite._transform import loss_scaling, scaled_value_and_grad

F16 = jnp.float16

# The tests check values, not speed: compiled with XLA's backend optimizations off (on 2 CPU
# cores compiling dominates their run time).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def stats_of(grads, **kwargs):
  return jit(lambda g: diag.gradient_statistics(g, **kwargs))(grads)


def as_float(x) -> float:
  return float(np.asarray(x))


# --------------------------------------------------------------------------------------------
# gradient_statistics


def test_hand_worked_statistics():
  grads = {
    "params": {
      "Dense_0": {
        "kernel": jnp.array([0.0, 1e-9, 3e-5, 1.0, 7e4, jnp.nan]),
        "bias": jnp.array([2.0**-30, 2.0**-70]),
      },
      "Dense_1": {"kernel": jnp.full((3,), -0.5)},
    }
  }
  stats = stats_of(grads, format="float16")
  assert list(stats) == ["params/Dense_0", "params/Dense_1"]  # kernel and bias: one layer
  s = stats["params/Dense_0"]
  assert int(s.size) == 8
  # 0 | 1e-9, 2^-30, 2^-70 round to 0 in fp16 | 3e-5 is subnormal | 7e4 > 65504 | NaN
  assert as_float(s.zero_fraction) == 1 / 8
  assert as_float(s.underflow_fraction) == 3 / 8
  assert as_float(s.subnormal_fraction) == 1 / 8
  assert as_float(s.overflow_fraction) == 1 / 8
  assert as_float(s.nonfinite_fraction) == 1 / 8
  assert as_float(s.max_abs) == 7e4  # the largest finite magnitude
  exponents = s.bin_exponents()
  nonzero = np.asarray(s.histogram) > 0
  counts = dict(
    zip(exponents[nonzero].tolist(), np.asarray(s.histogram)[nonzero].tolist(), strict=True)
  )
  # 2^-70 is below the range (open bin, labelled -65); 1e-9 and 2^-30 have exponent -30;
  # 3e-5 -> -16; 1.0 -> 0; 7e4 -> 16 = the top of the default range (open bin).
  assert counts == {-65: 1, -30: 2, -16: 1, 0: 1, 16: 1}
  assert int(s.histogram.sum()) == 6  # zeros and NaN are not binned
  d1 = stats["params/Dense_1"]
  assert as_float(d1.max_abs) == 0.5 and as_float(d1.underflow_fraction) == 0
  assert int(d1.histogram[d1.bin_exponents() == -1][0]) == 3


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_underflow_and_overflow_match_xla_casts(fmt):
  info = jl.format_info(fmt)
  rng = np.random.default_rng(0)
  # Values spread around both ends of the range, plus the exact rounding ties.
  ulp_top = 2.0 ** (np.floor(np.log2(info.max)) - info.mantissa_bits)
  values = np.concatenate(
    [
      info.min_subnormal * rng.uniform(0.01, 2.0, 500),
      np.minimum(info.max * rng.uniform(0.9, 1.2, 500), np.finfo(np.float32).max),
      [info.min_subnormal / 2, info.max + ulp_top / 2, info.max],
    ]
  ).astype(np.float32)
  stats = stats_of({"g": jnp.asarray(values)}, format=fmt)["g"]
  cast = np.asarray(jnp.asarray(values).astype(jnp.dtype(fmt))).astype(np.float32)
  assert as_float(stats.nonfinite_fraction) == 0
  assert round(as_float(stats.overflow_fraction) * values.size) == np.sum(~np.isfinite(cast)) > 0
  # bfloat16's underflow edge (4.6e-41) is a float32 subnormal, which XLA on CPU reads as 0.
  if fmt != "bfloat16":
    assert round(as_float(stats.underflow_fraction) * values.size) == np.sum(cast == 0) > 0


def test_loss_scale_moves_values_into_range():
  grads = {"w": jnp.array([1e-9, 1e-6, 1.0])}
  unscaled = stats_of(grads)["w"]
  assert as_float(unscaled.underflow_fraction) == pytest.approx(1 / 3)
  for scale in (2.0**15, jl.DynamicLossScale(2.0**15), jnp.float32(2.0**15)):
    scaled = diag.gradient_statistics(grads, loss_scale=scale)["w"]
    assert as_float(scaled.underflow_fraction) == 0
    assert as_float(scaled.overflow_fraction) == 0
    assert as_float(scaled.loss_scale) == 2.0**15
  too_high = diag.gradient_statistics(grads, loss_scale=2.0**17)["w"]
  assert as_float(too_high.overflow_fraction) == pytest.approx(1 / 3)  # 1.0 * 2^17 > 65504


def test_grouping_and_leaf_filtering():
  grads = {
    "encoder": {"layer_0": {"w": jnp.ones(2), "b": jnp.ones(1)}, "step": jnp.int32(3)},
    "head": jnp.zeros(4, F16),
    "unused": None,
  }
  assert set(stats_of(grads)) == {"encoder/layer_0", "head"}
  assert set(stats_of(grads, group_by="leaf")) == {
    "encoder/layer_0/w",
    "encoder/layer_0/b",
    "head",
  }
  by_top = stats_of(grads, group_by=1)
  assert set(by_top) == {"encoder", "head"} and int(by_top["encoder"].size) == 3
  custom = stats_of(grads, group_by=lambda name: name.split("/")[0].upper())
  assert set(custom) == {"ENCODER", "HEAD"}
  assert as_float(custom["HEAD"].zero_fraction) == 1.0
  float0 = jax.grad(lambda x, n: x * n, argnums=(0, 1), allow_int=True)(2.0, 3)
  assert list(diag.gradient_statistics(float0, group_by="leaf")) == ["0"]


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"group_by": "module"}, ValueError, "group_by"),
    ({"group_by": 0}, ValueError, "group_by"),
    ({"group_by": lambda n: 3}, TypeError, "string"),
    ({"format": "int8"}, TypeError, "int8"),
    ({"format": "float17"}, ValueError, "float17"),
    ({"loss_scale": "big"}, TypeError, "loss_scale"),
    ({"loss_scale": -1.0}, ValueError, "-1.0"),
    ({"loss_scale": jnp.ones(2)}, ValueError, "scalar"),
    ({"exponent_range": (10, 5)}, ValueError, "exponent_range"),
    ({"exponent_range": (-200, 0)}, ValueError, "-126"),
    ({"exponent_range": 5}, TypeError, "exponent_range"),
  ],
)
def test_statistics_argument_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    diag.gradient_statistics({"w": jnp.ones(2)}, **kwargs)


def test_histogram_can_be_skipped_and_range_set():
  grads = {"w": jnp.array([2.0**-3, 2.0**5])}
  none = diag.gradient_statistics(grads, exponent_range=None)["w"]
  assert none.histogram.shape == (0,)
  narrow = diag.gradient_statistics(grads, exponent_range=(-2, 3))["w"]
  assert narrow.histogram.shape == (7,)
  assert np.asarray(narrow.histogram).tolist() == [1, 0, 0, 0, 0, 0, 1]  # both ends open


def test_every_n_steps_runs_only_on_multiples():
  grads = {"w": jnp.array([0.0, 1.0])}

  @jit
  def metrics(step):
    return diag.every_n_steps(step, 3, diag.gradient_statistics, grads, format="bfloat16")

  for step in range(7):
    zero_fraction = as_float(metrics(step)["w"].zero_fraction)
    assert zero_fraction == (0.5 if step % 3 == 0 else 0.0)
  with pytest.raises(ValueError, match="n must"):
    diag.every_n_steps(0, 0, diag.gradient_statistics, grads)
  with pytest.raises(TypeError, match="integer scalar"):
    diag.every_n_steps(0.5, 2, diag.gradient_statistics, grads)


def test_statistics_under_shard_map_match_the_whole_array():
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  g = jnp.concatenate([jnp.zeros(4), jnp.full(4, 1e-9), jnp.full(4, 2.0), jnp.full(4, 7e4)])
  full = diag.gradient_statistics({"w": g})["w"]

  def local(shard):
    return diag.gradient_statistics({"w": shard}, axis_name="d")["w"]

  sharded = jit(
    jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec())
  )(g)
  for field in ("zero_fraction", "underflow_fraction", "overflow_fraction", "max_abs"):
    assert as_float(getattr(sharded, field)) == as_float(getattr(full, field)), field
  np.testing.assert_array_equal(sharded.histogram, full.histogram)


def test_stats_to_metrics_is_flat_and_scalar():
  metrics = diag.stats_to_metrics(diag.gradient_statistics({"a": {"w": jnp.ones(3)}}))
  assert set(metrics) == {
    f"grads/a/{f}"
    for f in (
      "zero_fraction",
      "nonfinite_fraction",
      "underflow_fraction",
      "subnormal_fraction",
      "overflow_fraction",
      "max_abs",
    )
  }
  assert all(np.shape(v) == () for v in metrics.values())


# --------------------------------------------------------------------------------------------
# Loss-scale health


def run_updates(pattern, loss_scale, window=4, **health_kwargs):
  """Feeds finite (True) / NaN (False) gradients through loss_scaling; returns healths."""
  tx = loss_scaling(optax.sgd(0.1), loss_scale)
  params = {"w": jnp.ones(2)}
  state, monitor = tx.init(params), diag.LossScaleMonitor.create(window=window)

  @jit
  def step(state, monitor, finite):
    grads = {"w": jnp.where(finite, 1.0, jnp.nan) * jnp.ones(2)}
    _, state = tx.update(grads, state, params)
    monitor = monitor.update(state)
    with_monitor = diag.loss_scale_health(state, monitor, **health_kwargs)
    without = diag.loss_scale_health(state, **health_kwargs)
    return state, monitor, with_monitor, without

  out = []
  for finite in pattern:
    state, monitor, h, h_bare = step(state, monitor, jnp.asarray(finite))
    out.append((jax.device_get(h), jax.device_get(h_bare)))
  return out


def test_collapse_after_k_steps_at_minimum():
  scale = jl.DynamicLossScale(jnp.float32(8), min_loss_scale=2.0)
  pattern = [False] * 8  # 8 -> 4 -> 2, then stuck at the minimum
  healths = run_updates(pattern, scale, max_steps_at_minimum=3)
  at_min = [int(h.steps_at_minimum) for h, _ in healths]
  assert [float(h.loss_scale) for h, _ in healths] == [4, 2, 2, 2, 2, 2, 2, 2]
  assert at_min == [0, 1, 2, 3, 4, 5, 6, 7]
  assert [bool(h.collapsed) for h, _ in healths] == [False, False, False] + [True] * 5
  # Without a monitor: consecutive skips while at the minimum, a lower bound.
  assert [int(b.steps_at_minimum) for _, b in healths] == [0, 2, 3, 4, 5, 6, 7, 8]
  assert "COLLAPSED" in healths[-1][0].describe()


def test_advice_names_public_functions():
  scale = jl.DynamicLossScale(jnp.float32(8), min_loss_scale=2.0)
  collapsed = run_updates([False] * 8, scale, max_steps_at_minimum=3)[-1][0].describe()
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
  skipping = run_updates([True, False] * 6, scale, window=4, max_skip_rate=0.25)[-1][0]
  named = re.findall(r"\bjl\.([\w.]+)\(", collapsed + skipping.describe())
  assert sorted(set(named)) == ["audit", "diagnostics.likely_culprits"]
  assert jl.diagnostics.likely_culprits.__name__ == "likely_culprits"


def test_recovering_run_is_healthy():
  # Two overflows at the start (the scale backs off), then clean steps: no alarm. The
  # scale reaches its minimum on the way but leaves it, so it never collapses.
  scale = jl.DynamicLossScale(jnp.float32(4), period=2, min_loss_scale=1.0)
  healths = run_updates([False, False] + [True] * 14, scale, window=12, max_steps_at_minimum=3)
  assert not any(bool(h.unhealthy) or bool(b.unhealthy) for h, b in healths)
  last = healths[-1][0]
  assert float(last.skip_rate) == 0.0 and int(last.skipped_steps) == 2
  assert float(last.loss_scale) == 128.0  # 1 at step 2, then x2 every 2 clean steps
  assert "healthy." in last.describe()


def test_skip_rate_over_the_window():
  # Every other step overflows: the scale oscillates and half the steps are lost.
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
  healths = run_updates([True, False] * 6, scale, window=4, max_skip_rate=0.25)
  rates = [float(h.skip_rate) for h, _ in healths]
  assert rates[:4] == pytest.approx([0.0, 0.5, 1 / 3, 0.5]) and rates[-1] == 0.5
  flagged = [bool(h.skip_rate_too_high) for h, _ in healths]
  assert flagged == [False, False, False] + [True] * 9  # judged once the window is full
  assert not any(bool(h.collapsed) for h, _ in healths)
  assert "TOO MANY SKIPS" in healths[-1][0].describe()
  # Without a monitor the total rate is judged after min_steps (default 100): not yet.
  assert not any(bool(b.skip_rate_too_high) for _, b in healths)


def test_static_scale_has_no_minimum_but_skips_count():
  healths = run_updates([False] * 5, jl.StaticLossScale(2.0**15), window=5, max_skip_rate=0.5)
  assert not any(bool(h.at_minimum) or bool(h.collapsed) for h, _ in healths)
  assert bool(healths[-1][0].skip_rate_too_high) and float(healths[-1][0].skip_rate) == 1.0


def test_layerwise_scale_collapses_when_a_stage_sits_at_its_minimum():
  scale = jl.LayerwiseLossScale({"a": 0, "b": 1}, initial_scale=2.0**14, min_loss_scale=2.0**8)
  tx = loss_scaling(optax.sgd(0.1), scale)
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  state, monitor = tx.init(params), diag.LossScaleMonitor.create(window=4)
  # What the layer-wise value-and-grad returns when stage 0's gradient is NaN.
  no_boundary = jl.layerwise.BoundaryStats(jnp.zeros(1), jnp.zeros((1, jl.layerwise.HIST_BINS)))
  nan = jl.ScaledGrads({"a": jnp.full(2, jnp.nan), "b": jnp.ones(2)}, no_boundary)

  @jit
  def step(state, monitor):
    _, state = tx.update(nan, state, params)
    monitor = monitor.update(state)
    return state, monitor, diag.loss_scale_health(state, monitor, max_steps_at_minimum=2)

  at_min = []
  for _ in range(5):
    state, monitor, health = step(state, monitor)
    at_min.append(bool(health.at_minimum))
  # The overflowing stage drops by margin_bits (3) per overflow: 2^14 -> 2^11 -> 2^8 = min.
  assert at_min == [False, True, True, True, True] and bool(health.collapsed)
  with pytest.raises(TypeError, match="loss_scale=1"):
    diag.gradient_statistics(params, loss_scale=scale)


def test_health_argument_errors():
  state = loss_scaling(optax.sgd(0.1), jl.NoOpLossScale()).init({"w": jnp.ones(1)})
  with pytest.raises(ValueError, match="max_steps_at_minimum"):
    diag.loss_scale_health(state, max_steps_at_minimum=0)
  with pytest.raises(ValueError, match="max_skip_rate"):
    diag.loss_scale_health(state, max_skip_rate=1.5)
  with pytest.raises(TypeError, match="LossScaleMonitor"):
    diag.loss_scale_health(state, monitor=object())
  with pytest.raises(ValueError, match="min_steps"):
    diag.loss_scale_health(state, min_steps=0)
  with pytest.raises(ValueError, match="window"):
    diag.LossScaleMonitor.create(window=0)
  with pytest.raises(ValueError, match="loss_scaling"):
    diag.loss_scale_health(optax.sgd(0.1).init({"w": jnp.ones(1)}))


# --------------------------------------------------------------------------------------------
# Culprits and forward order


def fake_stats(**layers):
  out = {}
  for name, (nonfinite, overflow, underflow) in layers.items():
    out[name] = diag.GradientStats(
      size=jnp.int32(100),
      zero_fraction=jnp.float32(0),
      nonfinite_fraction=jnp.float32(nonfinite),
      underflow_fraction=jnp.float32(underflow),
      subnormal_fraction=jnp.float32(0),
      overflow_fraction=jnp.float32(overflow),
      max_abs=jnp.float32(1),
      histogram=jnp.zeros(0, jnp.int32),
      min_exponent=jnp.int32(0),
      loss_scale=jnp.float32(1024),
    )
  return out


def test_culprit_is_the_non_finite_layer_closest_to_the_output():
  # NaN enters the backward pass at Dense_2 and spreads to Dense_1 and Dense_0.
  stats = fake_stats(
    Dense_0=(1, 0, 0), Dense_1=(1, 0, 0), Dense_2=(0.2, 0, 0), Dense_3=(0, 0, 0), Dense_10=(0, 0, 0)
  )
  (culprit,) = diag.likely_culprits(stats)
  assert culprit.name == "Dense_2" and culprit.problem == "non-finite"
  assert "2 earlier layers" in str(culprit)
  # Natural order puts Dense_10 last; an explicit forward order overrides it.
  order = ["Dense_3/kernel", "Dense_2/kernel", "Dense_1/kernel", "Dense_0/kernel"]
  assert diag.likely_culprits(stats, order=order)[0].name == "Dense_0"


def test_overflow_and_underflow_culprits_are_ranked():
  stats = fake_stats(a=(0, 0.01, 0), b=(0, 0.2, 0), c=(0, 0, 0.5), d=(0, 0, 0.005))
  culprits = diag.likely_culprits(stats, max_results=5)
  assert [(c.name, c.problem) for c in culprits] == [
    ("b", "overflow"),
    ("a", "overflow"),
    ("c", "underflow"),  # d is under the 1% threshold
  ]
  assert diag.likely_culprits(fake_stats(a=(0, 0, 0))) == ()
  with pytest.raises(TypeError, match="string"):
    diag.likely_culprits(stats, order="abc")


def test_parameter_order_follows_the_forward_pass():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      # Names deliberately out of alphabetical order.
      x = nn.Dense(4, name="zeta")(x)
      x = jax.jit(nn.relu)(nn.Dense(4, name="alpha")(x))
      return nn.Dense(1, name="mid")(x)

  x = jnp.ones((2, 3))
  params = jit(Net().init)(jax.random.key(0), x)
  policy = jl.get_policy("p=f32,c=f16,o=f32")
  # The policy casts every parameter first, in tree order: casts are not uses.
  order = diag.parameter_order(lambda p, x: Net().apply(policy.cast_to_compute(p), x), params, x)
  layers = list(dict.fromkeys(name.split("/")[1] for name in order))
  assert layers == ["zeta", "alpha", "mid"]


def test_every_layer_non_finite_names_the_first_layer_run():
  stats = fake_stats(Dense_0=(1, 0, 0), Dense_1=(0.5, 0, 0), Dense_2=(1, 0, 0))
  (culprit,) = diag.likely_culprits(stats)
  assert (culprit.name, culprit.problem, culprit.fraction) == ("Dense_0", "non-finite", 1.0)
  assert "at or before the first layer run" in culprit.explanation
  assert "every layer after it (2 layers)" in culprit.explanation
  order = ["Dense_2/kernel", "Dense_0/kernel", "Dense_1/kernel"]
  assert diag.likely_culprits(stats, order=order)[0].name == "Dense_2"


class OutOfOrderNet(nn.Module):
  """Three Dense layers run alpha, zeta, mid: tree (sorted) order is alpha, mid, zeta.

  Linear, so an inf in the input reaches every layer (a ReLU could zero it).
  """

  @nn.compact
  def __call__(self, x):
    for name in ("alpha", "zeta", "mid"):
      x = nn.Dense(4, name=name)(x)
    return x


EXECUTION_ORDER = tuple(
  f"params/{layer}/{leaf}" for layer in ("alpha", "zeta", "mid") for leaf in ("kernel", "bias")
)


def _one_device_replicated():
  # A trivial sharding: the constraint is in the jaxpr on any number of devices.
  return jax.sharding.NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec())


def test_parameter_order_looks_through_ops_that_only_move_or_annotate():
  from jax.ad_checkpoint import checkpoint_name

  x = jnp.ones((2, 3))
  params = jit(OutOfOrderNet().init)(jax.random.key(0), x)
  sharding = _one_device_replicated()
  moves = {
    "sharding_constraint": lambda p: jax.lax.with_sharding_constraint(p, sharding),
    "eqx.filter_shard": lambda p: eqx.filter_shard(p, sharding),
    "nn.with_logical_constraint": lambda p: jax.tree.map(
      lambda w: nn.with_logical_constraint(
        w, ("batch", "embed")[-w.ndim :], rules=(("embed", "data"),), mesh=sharding.mesh
      ),
      p,
    ),
    "optimization_barrier": jax.lax.optimization_barrier,
    "jit": jax.jit(lambda p: jax.tree.map(lambda w: w.astype(F16).astype(jnp.float32), p)),
    "device_put": lambda p: jax.device_put(p, sharding),
    "copy": lambda p: jax.tree.map(jnp.copy, p),
    "checkpoint_name": lambda p: jax.tree.map(lambda w: checkpoint_name(w, "w"), p),
  }
  for name, move in moves.items():
    # Each is really in the jaxpr (one kind of op on every parameter), not traced away.
    primitives = {e.primitive.name for e in jax.make_jaxpr(move)(params).jaxpr.eqns}
    assert len(primitives) == 1, (name, primitives)
    apply = lambda p, x, move=move: OutOfOrderNet().apply(move(p), x)
    assert diag.parameter_order(apply, params, x) == EXECUTION_ORDER, name
  everything = lambda p: functools.reduce(lambda p, move: move(p), moves.values(), p)
  assert diag.parameter_order(lambda p: OutOfOrderNet().apply(everything(p), x), params) == (
    EXECUTION_ORDER
  )
  # A parameter that is only constrained, never computed with, is unused: it comes last.
  extra = {"params": {**params["params"], "aaa_unused": jnp.ones(2)}}

  def loss_fn(p):
    p = dict(jax.lax.with_sharding_constraint(p, sharding)["params"])
    del p["aaa_unused"]
    return OutOfOrderNet().apply({"params": p}, x)

  assert diag.parameter_order(loss_fn, extra) == (*EXECUTION_ORDER, "params/aaa_unused")


def test_inf_at_the_input_of_a_sharded_loss_blames_the_first_layer():
  # FSDP-style code (and eqx.filter_shard, nn.with_logical_constraint) constrains every
  # parameter before the model runs; an inf in the batch makes every layer's gradients NaN.
  x = jnp.ones((2, 3))
  params = jit(OutOfOrderNet().init)(jax.random.key(0), x)
  sharding = _one_device_replicated()

  def loss_fn(p, x):
    p = jax.lax.with_sharding_constraint(p, sharding)
    return jnp.mean(OutOfOrderNet().apply(p, x) ** 2)

  order = diag.parameter_order(loss_fn, params, x)
  assert order == EXECUTION_ORDER
  poisoned = x.at[0, 1].set(jnp.inf)
  grads = jit(lambda p, x: scaled_value_and_grad(loss_fn, jl.StaticLossScale(2.0**8))(p, x)[1])(
    params, poisoned
  )
  stats = jax.device_get(stats_of(grads, format="float16"))
  assert all(as_float(s.nonfinite_fraction) > 0 for s in stats.values())  # every layer
  (culprit,) = diag.likely_culprits(stats, order=order)
  assert (culprit.name, culprit.problem) == ("params/alpha", "non-finite")
  assert "the cause is at or before the first layer run" in str(culprit)


# --------------------------------------------------------------------------------------------
# The whole loop: a NaN source is reported as a collapse, with the layer that causes it.


@jax.custom_vjp
def nan_in_backward(x, on):
  return x


nan_in_backward.defvjp(lambda x, on: (x, on), lambda on, g: (jnp.where(on, jnp.nan, g), None))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x, poison):
    for i, width in enumerate([16, 16, 16, 1]):
      x = nn.Dense(width, name=f"layer_{i}")(x)
      if i == 2:  # the NaN source: layer_2's backward pass
        x = nan_in_backward(x, poison)
      if i < 3:
        x = nn.relu(x)
    return x


@functools.cache
def trainer():
  model = MLP()

  @jit
  def init():  # compiled: eagerly, each initializer compiles at XLA's default optimization level
    x = jax.random.normal(jax.random.key(0), (8, 4))
    return x, jnp.sum(x, axis=1, keepdims=True), model.init(jax.random.key(1), x, False)

  x, y, params = init()
  tx = loss_scaling(optax.adam(1e-2), jl.DynamicLossScale(jnp.float32(2.0**8), min_loss_scale=16.0))

  def loss_fn(p, poison):
    return jnp.mean((model.apply(p, x, poison) - y) ** 2)

  def step(params, opt_state, monitor, poison, i):
    _, grads = scaled_value_and_grad(loss_fn, opt_state)(params, poison)
    stats = diag.every_n_steps(i, 1, diag.gradient_statistics, grads, format="float16")
    updates, opt_state = tx.update(grads, opt_state, params)
    monitor = monitor.update(opt_state)
    health = diag.loss_scale_health(opt_state, monitor, max_steps_at_minimum=5)
    return optax.apply_updates(params, updates), opt_state, monitor, stats, health

  first_args = (params, tx.init(params), diag.LossScaleMonitor.create(window=10), False, 0)
  order = diag.parameter_order(lambda p: loss_fn(p, False), params)
  return step, jit(step), first_args, order


def train(poison_from: int, steps: int = 14):
  step, compiled, first_args, order = trainer()
  params, opt_state, monitor, _, _ = first_args
  for i in range(steps):
    params, opt_state, monitor, stats, health = compiled(
      params, opt_state, monitor, jnp.asarray(i >= poison_from), i
    )
  return jax.device_get(health), jax.device_get(stats), order, (step, first_args)


def test_injected_nan_source_reports_collapse_and_culprit_layer():
  health, stats, order, (step, args) = train(poison_from=3)
  assert bool(health.collapsed) and bool(health.unhealthy)
  # Steps 3-13 are skipped; the scale halves from 2^8 to its minimum 16 by step 6, and the
  # 8 updates from step 6 on leave it there (docs/troubleshooting.md prints this run).
  assert float(health.loss_scale) == 16.0 and int(health.steps_at_minimum) == 8
  assert int(health.skipped_steps) == int(health.consecutive_skips) == 11
  culprits = diag.likely_culprits(stats, order=order)
  assert culprits[0].name == "params/layer_2" and culprits[0].problem == "non-finite"
  # The step stays free of host callbacks: diagnostics add no sync to the hot path.
  jaxpr = jax.make_jaxpr(jax.jit(step))(*args)  # the step as a user compiles it
  primitives = {e.primitive.name for e in _all_eqns(jaxpr.jaxpr)}
  # The walk sees inside the jit and every_n_steps' cond (the histogram's scatter-add).
  assert [e.primitive.name for e in jaxpr.jaxpr.eqns] == ["jit"]
  assert {"cond", "scatter-add", "dot_general"} <= primitives
  assert not [name for name in primitives if "callback" in name]


def test_clean_run_is_healthy_with_no_culprit():
  health, stats, order, _ = train(poison_from=10**6)
  assert not bool(health.unhealthy)
  assert diag.likely_culprits(stats, order=order) == ()


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _jaxpr.sub_jaxprs(eqn):
      yield from _all_eqns(sub.jaxpr)
