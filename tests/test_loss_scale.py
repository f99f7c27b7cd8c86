import dataclasses
import math
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import NamedSharding, PartitionSpec

import jmp_lite as jl

T, F = True, False


def _adjust(scale, finite):
  return scale.adjust(finite)


# One jitted function for every call: a new one per call compiled again for each hypothesis
# example; now a scale's configuration (its static fields) compiles once.
_jitted_adjust = jax.jit(_adjust)


def run(scale, pattern, use_jit):
  adjust = _jitted_adjust if use_jit else _adjust
  trajectory = []
  for finite in pattern:
    scale = adjust(scale, jnp.asarray(finite))
    trajectory.append((float(scale.loss_scale), int(scale.counter)))
  return scale, trajectory


def reference(scale, pattern, period, factor, lo, hi=math.inf, hysteresis=1, dtype=np.float32):
  """The documented rule, in plain Python (jmp's rule when hysteresis == 1)."""
  counter = streak = 0
  out = []
  for finite in pattern:
    if finite:
      streak = 0
      counter += 1
      if counter == period:
        counter = 0
        with np.errstate(over="ignore"):  # growth past the dtype's max: inf, refused below
          grown = float(np.asarray(scale * factor, dtype))
        if math.isfinite(grown) and grown <= hi:
          scale = grown
    else:
      counter = 0
      streak = min(streak + 1, hysteresis)
      if streak >= hysteresis:
        scale = max(scale / factor, lo)
    out.append((scale, counter))
  return out


@pytest.mark.parametrize("use_jit", [False, True])
def test_dynamic_hand_worked_trajectory(use_jit):
  scale = jl.DynamicLossScale(jnp.float32(8), period=3, factor=2, min_loss_scale=2.0)
  pattern = [T, T, T, T, F, T, T, T, F, F, F, F, T]
  _, trajectory = run(scale, pattern, use_jit)
  assert trajectory == [
    (8, 1),
    (8, 2),
    (16, 0),  # the 3rd consecutive finite step doubles
    (16, 1),
    (8, 0),  # overflow halves and resets the counter
    (8, 1),
    (8, 2),
    (16, 0),
    (8, 0),
    (4, 0),
    (2, 0),
    (2, 0),  # never below min_loss_scale
    (2, 1),
  ]


@pytest.mark.parametrize("use_jit", [False, True])
def test_dynamic_period_one_grows_every_finite_step(use_jit):
  scale = jl.DynamicLossScale(jnp.float32(1), period=1, factor=4)
  _, trajectory = run(scale, [T, T, F, T], use_jit)
  assert trajectory == [(4, 0), (16, 0), (4, 0), (16, 0)]


def test_hysteresis_backs_off_after_consecutive_overflows():
  scale = jl.DynamicLossScale(jnp.float32(64), period=2, hysteresis=3)
  pattern = [F, F, T, F, F, F, F, T, T]
  _, trajectory = run(scale, pattern, use_jit=True)
  assert [s for s, _ in trajectory] == [64, 64, 64, 64, 64, 32, 16, 16, 32]


def test_max_loss_scale_caps_growth():
  scale = jl.DynamicLossScale(jnp.float32(16), period=1, max_loss_scale=64)
  _, trajectory = run(scale, [T, T, T, T], use_jit=True)
  assert [s for s, _ in trajectory] == [32, 64, 64, 64]


@pytest.mark.parametrize(
  "dtype, start", [(jnp.float16, 2.0**14), (jnp.bfloat16, 2.0**126), (jnp.float32, 2.0**126)]
)
def test_growth_never_reaches_inf(dtype, start):
  scale = jl.DynamicLossScale(jnp.asarray(start, dtype), period=1)
  scale, trajectory = run(scale, [T] * 4, use_jit=True)
  assert scale.loss_scale.dtype == dtype
  assert all(math.isfinite(s) for s, _ in trajectory)
  assert trajectory[-1][0] == 2 * start  # one growth fits, then it stays


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_16_bit_loss_scale_works(dtype):
  # jmp fails here: min_loss_scale (f32) and the f16 scale meet in lax.select.
  scale = jl.DynamicLossScale(jnp.asarray(2.0**10, dtype), period=2)
  scale, trajectory = run(scale, [F, F, T, T], use_jit=True)
  assert scale.loss_scale.dtype == dtype
  assert [s for s, _ in trajectory] == [2.0**9, 2.0**8, 2.0**8, 2.0**9]
  grads = scale.unscale({"g": jnp.asarray([2.0**9], jnp.float16)})
  assert grads["g"].dtype == jnp.float32 and float(grads["g"][0]) == 1.0


@pytest.mark.parametrize("transform", ["jit", "tree_map", "scan", "pickle", "unflatten"])
def test_configuration_survives(transform):
  scale = jl.DynamicLossScale(
    jnp.float32(4), period=7, factor=4, min_loss_scale=2.0, max_loss_scale=2.0**20, hysteresis=2
  )
  if transform == "jit":
    out = jax.jit(lambda s: s)(scale)
  elif transform == "tree_map":
    out = jax.tree.map(lambda x: x, scale)
  elif transform == "scan":
    out, _ = jax.lax.scan(lambda s, _: (s.adjust(jnp.array(False)), None), scale, None, length=3)
  elif transform == "pickle":
    out = pickle.loads(pickle.dumps(scale))
  else:
    leaves, treedef = jax.tree.flatten(scale)
    out = jax.tree.unflatten(treedef, leaves)
  assert (out.period, out.factor, out.min_loss_scale, out.max_loss_scale, out.hysteresis) == (
    7,
    4,
    2.0,
    2.0**20,
    2,
  )
  if transform == "scan":
    # Two overflows with hysteresis 2 back off once: 4 / 4 = 1, clamped to min 2.
    assert float(out.loss_scale) == 2.0


def test_leaves_have_named_paths():
  scale = jl.DynamicLossScale(jnp.float32(4))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(scale)]
  assert paths == [".loss_scale", ".counter", ".overflow_streak"]
  assert jax.tree.leaves(jl.NoOpLossScale()) == []
  assert len(jax.tree.leaves(jl.StaticLossScale(2.0))) == 1


def test_jitted_step_traces_once_as_the_scale_moves():
  traces = []

  @jax.jit
  def step(scale, finite):
    traces.append(None)
    return scale.adjust(finite)

  # A Python float scale must not come back weakly typed and trigger a retrace.
  scale = jl.DynamicLossScale(2.0**15, period=1)
  for finite in [T, F, F, T, T, F]:
    scale = step(scale, jnp.asarray(finite))
  assert len(traces) == 1


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("use_jit", [False, True])
def test_scale_and_unscale(kind, use_jit):
  s = 2.0**12
  scale = jl.StaticLossScale(s) if kind == "static" else jl.DynamicLossScale(s)
  tree = {
    "f32": jnp.float32(3.0),
    "f16": jnp.ones(2, jnp.float16),
    "i": jnp.arange(2),
    "none": None,
  }
  scaled = (jax.jit(scale.scale) if use_jit else scale.scale)(tree)
  assert float(scaled["f32"]) == 3.0 * s
  assert scaled["f16"].dtype == jnp.float32  # jmp's promotion with a f32 scale
  assert scaled["i"] is tree["i"] or np.array_equal(scaled["i"], tree["i"])
  unscaled = (jax.jit(scale.unscale) if use_jit else scale.unscale)(
    {"g16": jnp.asarray([2.0**-10], jnp.float16), "i": jnp.arange(2)}
  )
  # 2^-10 / 2^12 = 2^-22 is below fp16's normal range: unscaling in fp32 keeps it exact.
  assert unscaled["g16"].dtype == jnp.float32 and float(unscaled["g16"][0]) == 2.0**-22
  assert unscaled["i"].dtype == jnp.int32


def test_unscale_skips_float0_gradients():
  grads = jax.grad(lambda x, n: x * n, argnums=(0, 1), allow_int=True)(2.0, 3)
  out = jl.StaticLossScale(4.0).unscale(grads)
  assert float(out[0]) == 0.75 and out[1].dtype == jax.dtypes.float0
  assert bool(jl.all_finite(grads))


def test_no_op_loss_scale():
  scale = jl.NoOpLossScale()
  tree = {"a": jnp.ones(2, jnp.float16)}
  assert scale.scale(tree) is tree and scale.unscale(tree) is tree
  assert scale.adjust(jnp.array(False)) is scale
  assert float(scale.loss_scale) == 1.0


def test_static_adjust_is_identity():
  scale = jl.StaticLossScale(jnp.float32(128))
  assert scale.adjust(jnp.array(False)) is scale


@given(
  hnp.arrays(
    np.float32,
    hnp.array_shapes(max_dims=2, max_side=6),
    elements=st.floats(-1e6, 1e6, width=32, allow_nan=False),
  ),
  st.integers(-60, 60),
)
def test_power_of_two_scaling_is_exact(x, k):
  # fp32 subnormals are out of scope: XLA:CPU flushes them in some code paths.
  tiny = np.finfo(np.float32).tiny
  expected = np.ldexp(x.astype(np.float64), k)
  normal = (np.abs(x) >= tiny) & (np.abs(expected) >= tiny)
  scale = jl.StaticLossScale(jnp.float32(2.0**k))
  scaled = np.asarray(scale.scale(jnp.asarray(x)))
  np.testing.assert_array_equal(scaled[normal], expected[normal].astype(np.float32))
  back = np.asarray(scale.unscale(jnp.asarray(scaled)))
  np.testing.assert_array_equal(back[normal], x[normal])


@given(
  st.lists(st.booleans(), max_size=40),
  st.integers(1, 4),
  st.sampled_from([2, 4]),
  st.integers(-4, 4),
  st.integers(0, 8),
  st.integers(0, 12),
  st.integers(1, 3),
)
def test_dynamic_matches_reference_and_stays_in_bounds(
  pattern, period, factor, lo_exp, start_up, span, hysteresis
):
  lo = 2.0**lo_exp
  start = lo * 2.0**start_up
  hi = start * 2.0**span
  scale = jl.DynamicLossScale(
    jnp.float32(start),
    period=period,
    factor=factor,
    min_loss_scale=lo,
    max_loss_scale=hi,
    hysteresis=hysteresis,
  )
  _, trajectory = run(scale, pattern, use_jit=True)
  assert trajectory == reference(start, pattern, period, factor, lo, hi, hysteresis)
  for s, _ in trajectory:
    assert lo <= s <= hi
    assert math.frexp(s)[0] == 0.5  # still a power of two


@given(st.lists(st.booleans(), max_size=60))
def test_fp16_scale_never_overflows(pattern):
  scale = jl.DynamicLossScale(jnp.float16(2.0**13), period=1)
  _, trajectory = run(scale, pattern, use_jit=True)
  # 2^15 * 2 is inf in fp16: the reference's growth check, in fp16, refuses it too.
  assert trajectory == reference(2.0**13, pattern, 1, 2, 1.0, dtype=np.float16)
  assert all(1 <= s <= 2.0**15 for s, _ in trajectory)


def test_scale_inside_scan_over_a_training_loop():
  def body(scale, finite):
    new = scale.adjust(finite)
    return new, new.loss_scale

  pattern = jnp.asarray([T, T, F, T, T, T, T])
  _, scales = jax.lax.scan(body, jl.DynamicLossScale(jnp.float32(8), period=2), pattern)
  np.testing.assert_array_equal(scales, [8, 16, 8, 8, 16, 16, 32])


# Validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [jl.StaticLossScale, jl.DynamicLossScale])
@pytest.mark.parametrize(
  "value, error, match",
  [
    (0.0, ValueError, "positive and finite"),
    (-2.0, ValueError, "positive"),
    (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"),
    (jnp.float16(70000.0), ValueError, "inf"),
    (jnp.ones(2), ValueError, "scalar"),
    (True, TypeError, "positive number"),
    (jnp.array(True), TypeError, "positive number"),
    ("2", TypeError, "a positive number or a scalar array, got str"),
    (jnp.complex64(2), TypeError, "complex"),
  ],
)
def test_bad_loss_scale(cls, value, error, match):
  with pytest.raises(error, match=match):
    cls(value)


def test_integer_loss_scale_is_converted_to_float32():
  # jmp users write DynamicLossScale(jnp.asarray(2 ** 15)); that is an int32 array.
  scale = jl.DynamicLossScale(jnp.asarray(2**15))
  assert scale.loss_scale.dtype == jnp.float32 and float(scale.loss_scale) == 2.0**15


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"period": 0}, ValueError, "period must be >= 1"),
    ({"period": 2.5}, TypeError, "period"),
    ({"period": True}, TypeError, "period"),
    ({"factor": 1}, ValueError, "factor"),
    ({"factor": 0.5}, ValueError, "factor"),
    ({"factor": float("inf")}, ValueError, "factor"),
    ({"factor": "2"}, TypeError, "factor"),
    ({"min_loss_scale": -1.0}, ValueError, r"min_loss_scale must be a finite number >= 0"),
    ({"min_loss_scale": float("nan")}, ValueError, "min_loss"),
    ({"min_loss_scale": 2.0**20}, ValueError, r"outside \[min_loss_scale"),
    ({"max_loss_scale": 2.0**10}, ValueError, r"outside"),
    ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError, "below min_loss_scale"),
    ({"max_loss_scale": -1.0}, ValueError, "max_loss_scale"),
    ({"hysteresis": 0}, ValueError, "hysteresis"),
    ({"counter": 2000}, ValueError, "counter"),
    ({"counter": -1}, ValueError, "counter"),
    ({"counter": 1.5}, TypeError, "counter"),
    ({"min_loss_scale": "1"}, TypeError, "min_loss_scale"),
  ],
)
def test_bad_dynamic_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    jl.DynamicLossScale(jnp.float32(2.0**15), **kwargs)


def test_bounds_must_be_representable_in_the_scale_dtype():
  with pytest.raises(ValueError, match="not representable"):
    jl.DynamicLossScale(jnp.float16(2.0**10), max_loss_scale=2.0**17)
  with pytest.raises(ValueError, match="not representable"):
    jl.DynamicLossScale(jnp.float16(2.0**10), min_loss_scale=2.0**-30)


def test_traced_loss_scale_is_accepted_but_traced_bound_is_not():
  out = jax.jit(lambda s: jl.DynamicLossScale(s).adjust(jnp.array(False)).loss_scale)(
    jnp.float32(-1)
  )  # values are not checked under tracing
  assert float(out) == 1.0  # clamped to min_loss_scale
  with pytest.raises(TypeError, match="concrete"):
    jax.jit(lambda m: jl.DynamicLossScale(8.0, min_loss_scale=m))(jnp.float32(1))


@pytest.mark.parametrize("cls", [jl.NoOpLossScale, jl.StaticLossScale, jl.DynamicLossScale])
def test_adjust_rejects_bad_predicates(cls):
  scale = cls() if cls is jl.NoOpLossScale else cls(2.0)
  with pytest.raises(ValueError, match="shape"):
    scale.adjust(jnp.array([True, False]))
  with pytest.raises(TypeError, match="boolean"):
    scale.adjust(jnp.float32(1.0))
  with pytest.raises(TypeError, match="boolean"):
    jax.jit(scale.adjust)(jnp.int32(1))


# all_finite and select_tree -----------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_all_finite(use_jit, bad, dtype):
  tree = {"a": jnp.ones((3, 2), dtype), "b": [jnp.arange(3), jnp.zeros(4, jnp.float32)], "c": None}
  if bad is not None:
    tree["b"][1] = tree["b"][1].at[2].set(bad)
  f = jax.jit(jl.all_finite) if use_jit else jl.all_finite
  result = f(tree)
  assert result.dtype == jnp.bool_ and result.shape == ()
  assert bool(result) == (bad is None)


@pytest.mark.parametrize("use_jit", [False, True])
def test_all_finite_is_exact_when_the_sum_of_finite_values_overflows(use_jit):
  f = jax.jit(jl.all_finite) if use_jit else jl.all_finite
  big = float(np.finfo(np.float32).max)
  assert bool(f({"a": jnp.full(4, big), "b": jnp.full(3, -big)}))
  assert bool(f([jnp.full(1000, 60000.0, jnp.float16)]))  # would overflow an fp16 sum
  assert not bool(f({"a": jnp.full(4, big), "b": jnp.asarray([1.0, jnp.nan])}))


def test_all_finite_of_empty_tree():
  assert bool(jl.all_finite({})) and bool(jl.all_finite([None]))


def test_select_tree():
  a = {"x": jnp.ones(2), "y": jnp.int32(1)}
  b = {"x": jnp.zeros(2), "y": jnp.int32(2)}
  out = jax.jit(jl.select_tree)(jnp.array(True), a, b)
  np.testing.assert_array_equal(out["x"], a["x"])
  out = jl.select_tree(jnp.array(False), a, b)
  np.testing.assert_array_equal(out["x"], b["x"])
  assert int(out["y"]) == 2


def test_select_tree_errors():
  a, b = {"x": jnp.ones(2)}, {"x": jnp.zeros(2)}
  with pytest.raises(ValueError, match="shape"):
    jl.select_tree(jnp.array([True, False]), a, b)
  with pytest.raises(TypeError, match="boolean"):
    jl.select_tree(jnp.float32(1), a, b)
  with pytest.raises(ValueError):
    jl.select_tree(jnp.array(True), a, {"y": jnp.zeros(2)})
  with pytest.raises(TypeError):
    jl.select_tree(jnp.array(True), a, {"x": jnp.zeros(2, jnp.int32)})


def test_select_tree_takes_shared_non_array_leaves_as_they_are():
  # An Equinox module's tree holds its activation functions as leaves.
  a, b = {"act": jnp.tanh, "w": jnp.ones(2)}, {"act": jnp.tanh, "w": jnp.zeros(2)}
  out = jl.select_tree(jnp.array(False), a, b)
  assert out["act"] is jnp.tanh
  np.testing.assert_array_equal(out["w"], b["w"])
  with pytest.raises(TypeError, match=r"select_tree: the leaves at \['act'\] are not both arrays"):
    jl.select_tree(jnp.array(True), a, {"act": jnp.sin, "w": jnp.zeros(2)})


# Multi-device: 8 host CPU devices (see conftest.py) --------------------------------------


def _mesh():
  devices = jax.devices()
  assert len(devices) == 8, "tests expect 8 host CPU devices; see tests/conftest.py"
  return jax.make_mesh((8,), ("data",), devices=devices)


@pytest.mark.parametrize("poisoned_shard", [None, 0, 5])
def test_all_finite_with_axis_name_under_shard_map(poisoned_shard):
  mesh = _mesh()
  grads = jnp.ones((8, 4))
  if poisoned_shard is not None:
    grads = grads.at[poisoned_shard, 1].set(jnp.nan)
  grads = jax.device_put(grads, NamedSharding(mesh, PartitionSpec("data")))

  def per_device(g):
    local = jl.all_finite(g)
    return jl.all_finite(g, axis_name="data")[None], local[None]

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")
    )
  )
  global_, local = f(grads)
  expected_local = np.arange(8) != poisoned_shard
  np.testing.assert_array_equal(local, expected_local)
  np.testing.assert_array_equal(global_, np.full(8, poisoned_shard is None))


def test_all_finite_with_axis_name_under_pmap_and_vmap():
  grads = jnp.ones((8, 3)).at[6, 0].set(jnp.inf)
  out = jax.pmap(lambda g: jl.all_finite(g, axis_name="i"), axis_name="i")(grads)
  np.testing.assert_array_equal(out, np.zeros(8, bool))
  out = jax.vmap(lambda g: jl.all_finite(g, axis_name="i"), axis_name="i")(grads)
  np.testing.assert_array_equal(out, np.zeros(8, bool))
  out = jax.vmap(jl.all_finite)(grads)
  np.testing.assert_array_equal(out, np.arange(8) != 6)


def test_all_finite_is_global_under_sharded_jit():
  mesh = _mesh()
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  grads = jax.device_put(jnp.ones((16, 4)).at[13, 2].set(jnp.inf), sharding)
  assert len(grads.addressable_shards) == 8
  assert not bool(jax.jit(jl.all_finite)(grads))
  assert bool(jax.jit(jl.all_finite)(jax.device_put(jnp.ones((16, 4)), sharding)))


def test_dynamic_scale_adjust_under_shard_map_keeps_devices_in_step():
  mesh = _mesh()
  grads = jnp.ones((8, 2)).at[3, 0].set(jnp.inf)
  grads = jax.device_put(grads, NamedSharding(mesh, PartitionSpec("data")))

  def per_device(g):
    scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
    new = scale.adjust(jl.all_finite(g, axis_name="data"))
    return new.loss_scale[None]

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")
    )
  )
  np.testing.assert_array_equal(f(grads), np.full(8, 2.0**9))


# The loss-scale contract --------------------------------------------------------------------

KINDS = [
  jl.NoOpLossScale(),
  jl.StaticLossScale(jnp.float32(2.0**4)),
  jl.DynamicLossScale(jnp.float32(2.0**4)),
  jl.LayerwiseLossScale({"w": 0, "b": 0}, initial_scale=2.0**4),
]


@pytest.mark.parametrize("scale", KINDS, ids=lambda s: type(s).__name__)
def test_every_kind_implements_the_contract(scale):
  # scale multiplies by loss_scale; adjust keeps the kind, and on overflow the kinds that
  # adapt back off once (to half).
  assert float(scale.scale(jnp.float32(3.0))) == 3.0 * float(scale.loss_scale)
  backs_off = isinstance(scale, (jl.DynamicLossScale, jl.LayerwiseLossScale))
  for finite, factor in ((True, 1.0), (False, 0.5 if backs_off else 1.0)):
    adjusted = scale.adjust(jnp.asarray(finite))
    assert type(adjusted) is type(scale)
    assert float(adjusted.loss_scale) == factor * float(scale.loss_scale), finite
  params = {"w": jnp.asarray([1.0, -2.0]), "b": jnp.asarray(0.5)}
  loss_fn = lambda p, x: jnp.sum(p["w"] * x) + p["b"] ** 2
  x = jnp.asarray([3.0, 0.25])
  value, scaled = scale.value_and_grad(loss_fn)(params, x)
  assert float(value) == float(loss_fn(params, x))  # unscaled
  grads, finite, next_scale = scale.unscale_and_adjust(scaled, params)
  true = jax.grad(loss_fn)(params, x)
  for name in params:  # powers of two: exact
    np.testing.assert_array_equal(grads[name], true[name])
  np.testing.assert_array_equal(scale.unscale(scaled)["w"], true["w"])
  assert bool(finite) and type(next_scale) is type(scale)
  assert not bool(scale.at_minimum)
  assert float(scale.loss_scale) == (1.0 if isinstance(scale, jl.NoOpLossScale) else 16.0)
  # Every gradient carries one scale here (the layer-wise scale has one stage).
  assert float(scale.gradient_scale) == float(scale.loss_scale)


STAGED = {"w": 0, "b": 1}  # two stages: each gradient carries its own stage's scale


def _staged_loss(p, x):
  return jnp.sum(p["b"] * jl.stage_boundary(p["w"] * x, 0))


@pytest.mark.parametrize(
  "scale",
  [*KINDS, jl.LayerwiseLossScale(STAGED).with_scales([2.0**10, 2.0**4])],
  ids=lambda s: f"{type(s).__name__}{getattr(s, 'num_stages', '')}",
)
def test_every_kind_answers_every_contract_method(scale):
  # No kind refuses a member: scale multiplies by loss_scale; a bare tree (jax.grad of scale's
  # loss) and what value_and_grad returns both unscale to the true gradients; gradient_scale is
  # the one scale of every gradient, or None (two stages, each its own).
  several = getattr(scale, "num_stages", 1) > 1
  loss_fn = _staged_loss if several else lambda p, x: jnp.sum(p["b"] * p["w"] * x)
  params = {"w": jnp.asarray([1.0, -2.0]), "b": jnp.asarray([0.5, 4.0])}
  x = jnp.asarray([3.0, 0.25])
  true = jax.grad(loss_fn)(params, x)
  S = float(scale.loss_scale)
  assert float(scale.scale(jnp.float32(3.0))) == 3.0 * S
  bare = jax.grad(lambda p: scale.scale(loss_fn(p, x)))(params)
  np.testing.assert_array_equal(bare["w"], true["w"] * S)
  _, scaled = scale.value_and_grad(loss_fn)(params, x)
  for grads in (bare, scaled):
    unscaled = scale.unscale(grads)
    for name in params:  # powers of two: exact
      np.testing.assert_array_equal(unscaled[name], true[name])
  assert type(scaled) is (jl.ScaledGrads if isinstance(scale, jl.LayerwiseLossScale) else dict)
  assert jl.ScaledGrads.of(scaled).packed() is scaled
  if several:
    assert scale.gradient_scale is None
    np.testing.assert_array_equal(scaled.grads["w"], true["w"] * 2.0**10)  # stage 0's scale
  else:
    assert float(scale.gradient_scale) == S
  if several:  # bare gradients have no boundary statistics to update the stages' scales with
    with pytest.raises(TypeError, match="with 2 stages got bare gradients"):
      scale.unscale_and_adjust(bare, params)
  grads, finite, following = scale.unscale_and_adjust(scaled if several else bare, params)
  assert bool(finite) and type(following) is type(scale)
  for name in params:
    np.testing.assert_array_equal(grads[name], true[name])
  _, finite, _ = scale.unscale_and_adjust(jax.tree.map(lambda g: g * jnp.inf, scaled), params)
  assert not bool(finite)


@pytest.mark.parametrize("scale", KINDS, ids=lambda s: type(s).__name__)
def test_every_kind_takes_the_grad_options_by_keyword_and_refuses_others(scale):
  # has_aux, argnums and value_and_grad (jl.GradOptions) mean what they mean for
  # jax.value_and_grad, through the loss scale's method and through jl.scaled_value_and_grad;
  # a misspelt option is a TypeError naming it, not ignored.
  params = {"w": jnp.asarray([1.0, -2.0]), "b": jnp.asarray(0.5)}
  loss_fn = lambda x, p: (jnp.sum(p["w"] * x) + p["b"] ** 2, x)
  x = jnp.asarray([3.0, 0.25])
  calls = []

  def transform(fun, **kwargs):
    calls.append(kwargs)
    return jax.value_and_grad(fun, **kwargs)

  options = jl.GradOptions(has_aux=True, argnums=1, value_and_grad=transform)
  for grad_fn in (
    scale.value_and_grad(loss_fn, **options),
    jl.scaled_value_and_grad(loss_fn, scale, **options),
  ):
    (value, aux), scaled = grad_fn(x, params)
    assert float(value) == float(loss_fn(x, params)[0]) and aux is x
    true = jax.grad(lambda p: loss_fn(x, p)[0])(params)
    np.testing.assert_array_equal(scale.unscale(scaled)["w"], true["w"])
  assert len(calls) == 2 and all(c["has_aux"] is True for c in calls)
  for bad in ({"has_axu": True}, {"has_aux": True, "argnum": 0}):
    with pytest.raises(TypeError, match=f"unexpected keyword arguments \\['{[*bad][-1]}'\\]"):
      scale.value_and_grad(loss_fn, **bad)
    with pytest.raises(TypeError, match="takes has_aux, argnums and value_and_grad"):
      jl.scaled_value_and_grad(loss_fn, scale, **bad)


def test_the_protocol_has_no_runtime_check_and_recognition_evaluates_no_property():
  with pytest.raises(TypeError, match="runtime_checkable"):
    isinstance(jl.NoOpLossScale(), jl.LossScale)

  class Exploding(HalvingScale):
    @property
    def loss_scale(self):
      raise AssertionError("a property was evaluated")

  # jl.loss_scaling and jl.get_loss_scale recognise a loss scale by its type alone.
  for kind in (Exploding(1.0), jl.DynamicLossScale(2.0)):
    jl.loss_scaling(optax.sgd(1.0), kind)
  assert jl.get_loss_scale(scale := Exploding(1.0)) is scale
  with pytest.raises(TypeError, match=r"^loss_scale must be a jmp_lite\.LossScale .* got 2\.0 of"):
    jl.loss_scaling(optax.sgd(1.0), 2.0)
  with pytest.raises(TypeError, match=r"^loss_scale must be a jmp_lite\.LossScale .* of type dict"):
    jl.loss_scaling(optax.sgd(1.0), {"loss_scale": 1.0})


def _all_kinds():
  return [
    jl.NoOpLossScale(),
    jl.StaticLossScale(8.0),
    jl.DynamicLossScale(jnp.float32(4.0), period=3, min_loss_scale=2.0, hysteresis=2),
    jl.LayerwiseLossScale(STAGED, initial_scale=[2.0**6, 2.0**2], update_period=2),
  ]


@pytest.mark.parametrize("scale", _all_kinds(), ids=lambda s: type(s).__name__)
def test_unflattening_checks_nothing_and_keeps_every_field(scale):
  leaves, treedef = jax.tree.flatten(scale)
  # Placeholders of any kind go in as they are: no check ran (None or object() would fail one).
  for placeholder in (object(), None):
    rebuilt = jax.tree.unflatten(treedef, [placeholder] * len(leaves))
    data = [f.name for f in dataclasses.fields(rebuilt) if not f.metadata.get("static")]
    assert all(getattr(rebuilt, name) is placeholder for name in data) and len(data) == len(leaves)
  traced = []
  out = jax.jit(lambda s: traced.append(s) or jax.tree.map(lambda x: -x, s))(scale)
  assert all(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(traced[0]))
  # Negated leaves (an invalid negative scale) pass through unchecked; the configuration stays.
  for x, y in zip(jax.tree.leaves(out), leaves, strict=True):
    np.testing.assert_array_equal(x, -np.asarray(y))
  assert jax.tree.structure(out) == treedef
  assert jax.tree.structure(jax.tree.unflatten(treedef, leaves)) == treedef


def test_unflattening_a_zero_floor_scale_warns_nothing():
  with pytest.warns(UserWarning, match="min_loss_scale=0"):
    scale = jl.DynamicLossScale(jnp.float32(1.0), min_loss_scale=0.0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the warning is for the user's construction only
    jax.jit(lambda s: s.adjust(jnp.array(False)))(scale)
    jax.tree.map(lambda x: x, scale)


def test_fields_declare_their_roles_and_a_static_change_retraces():
  scale = jl.DynamicLossScale(jnp.float32(4.0), period=3)
  assert [f.name for f in dataclasses.fields(scale) if f.metadata.get("static")] == [
    "period", "factor", "min_loss_scale", "max_loss_scale", "hysteresis", "_checked"
  ]  # fmt: skip
  traces = []

  @jax.jit
  def f(s):
    traces.append(1)
    return s.loss_scale * s.period

  assert float(f(scale)) == 12.0 and float(f(scale.adjust(jnp.array(True)))) == 12.0
  assert len(traces) == 1
  assert float(f(jl.DynamicLossScale(jnp.float32(4.0), period=5))) == 20.0
  assert len(traces) == 2


@pytest.mark.parametrize(
  ("make", "match"),
  [
    (lambda: jl.StaticLossScale(-2.0), "loss_scale"),
    (lambda: jl.DynamicLossScale(2.0, period=0), "period"),
    (lambda: jl.LayerwiseLossScale(STAGED, update_period=0), "update_period"),
    (lambda: jl.LayerwiseLossScale(STAGED).replace(margin_bits=-1), "margin_bits"),
    (lambda: jl.LayerwiseLossScale(STAGED).replace(amax_history_length=3), "amax_history"),
  ],
)
def test_a_bad_value_at_construction_or_replace_raises_naming_it(make, match):
  with pytest.raises((TypeError, ValueError), match=match):
    make()


def test_dynamic_scale_at_its_floor_is_at_minimum():
  assert bool(jl.DynamicLossScale(jnp.float32(1.0)).at_minimum)
  assert not bool(jl.DynamicLossScale(jnp.float32(2.0)).at_minimum)


class HalvingScale:
  """A loss scale a user writes: it delegates to a static scale and halves on overflow."""

  def __init__(self, value):
    self.inner = jl.StaticLossScale(value)

  loss_scale = property(lambda self: self.inner.loss_scale)
  gradient_scale = property(lambda self: self.inner.gradient_scale)
  at_minimum = property(lambda self: jnp.asarray(False))
  scale = lambda self, tree: self.inner.scale(tree)
  unscale = lambda self, tree: self.inner.unscale(tree)
  adjust = lambda self, finite: HalvingScale(
    jnp.where(finite, self.loss_scale, self.loss_scale / 2)
  )
  value_and_grad = lambda self, fun, **kwargs: self.inner.value_and_grad(fun, **kwargs)

  def unscale_and_adjust(self, scaled_grads, params=None, *, axis_name=None):
    grads, finite, _ = self.inner.unscale_and_adjust(scaled_grads, params, axis_name=axis_name)
    return grads, finite, self.adjust(finite)


jax.tree_util.register_pytree_node(
  HalvingScale, lambda s: ((s.loss_scale,), None), lambda _, c: HalvingScale(c[0])
)


def test_a_kind_written_by_a_user_plugs_into_loss_scaling():
  import optax

  scale = HalvingScale(jnp.float32(8.0))
  tx = jl.loss_scaling(optax.sgd(1.0), scale)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  # Taken as it is (it has the contract's members), its arrays copied: a state owns its buffers.
  initial = jl.get_loss_scale(state)
  assert type(initial) is HalvingScale and float(initial.loss_scale) == 8.0
  assert initial.loss_scale is not scale.loss_scale
  _, grads = jl.scaled_value_and_grad(lambda p: jnp.sum(p["w"]) * 3, state)(params)
  np.testing.assert_array_equal(grads["w"], [24.0, 24.0])
  updates, state = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_array_equal(updates["w"], [-3.0, -3.0])
  _, state = tx.update({"w": jnp.asarray([jnp.inf, 0.0])}, state, params)
  # The user's own adjust ran: the next scale is a HalvingScale at half.
  next_scale = jl.get_loss_scale(state)
  assert type(next_scale) is HalvingScale and float(next_scale.loss_scale) == 4.0
  with pytest.raises(TypeError, match=r"jmp_lite\.LossScale"):
    jl.loss_scaling(optax.sgd(1.0), object())


def test_gradient_scale_value_reads_every_kind_of_scale_the_same_way():
  from jmp_lite._loss_scale import gradient_scale_value

  read = lambda s: gradient_scale_value(s, instead="Do this instead.")
  for scale, expected in [
    (jl.StaticLossScale(8.0), 8.0),
    (jl.DynamicLossScale(jnp.float16(1024)), 1024.0),
    (jl.NoOpLossScale(), 1.0),
    (4, 4.0),
    (np.float64(0.5), 0.5),
    (jnp.bfloat16(2.0**20), 2.0**20),
  ]:
    value = read(scale)
    assert value.dtype == jnp.float32 and value.shape == () and float(value) == expected
  # Traced values are converted, not checked.
  assert jax.jit(read)(jnp.float32(-1)).dtype == jnp.float32
  assert float(jax.jit(lambda s: read(s))(jl.DynamicLossScale(jnp.float32(64)))) == 64.0
  assert float(read(jl.LayerwiseLossScale([0, 0], initial_scale=8.0))) == 8.0  # one stage
  with pytest.raises(TypeError, match=r"carry more than one scale.* Do this instead\.$"):
    read(jl.LayerwiseLossScale([0, 1]))
  assert float(read(HalvingScale(jnp.float32(2.0)))) == 2.0  # a user's kind
  for bad, match in [
    (True, "got bool"),
    ("2.0", "got str"),
    (None, "got NoneType"),
    (np.complex64(1), "real number, got dtype complex64"),
  ]:
    with pytest.raises(TypeError, match=match):
      read(bad)
  # The right kind of value, but not one the scale can be: a ValueError.
  with pytest.raises(ValueError, match=r"loss_scale must be a scalar, got shape \(2,\)"):
    read(jnp.ones(2))
  for bad in (0.0, -2.0, np.inf, np.nan):
    with pytest.raises(ValueError, match="positive and finite"):
      read(bad)


def test_a_zero_floor_is_accepted_with_a_warning_and_the_scale_can_collapse_to_0():
  # jmp accepts min_loss_scale=0 (its own test suite builds one); jmp_lite does too, and says
  # what it allows: halving underflows to 0, and a step at scale 0 is never finite.
  with pytest.warns(UserWarning, match=r"^min_loss_scale=0: .* down to 0") as caught:
    scale = jl.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.asarray(0.0))
  assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
  assert scale.min_loss_scale == 0.0 and not bool(scale.at_minimum)
  halve = jax.jit(lambda s, n: jax.lax.fori_loop(0, n, lambda _, s: s.adjust(jnp.array(F)), s))
  assert float(halve(scale, 100).loss_scale) == 2.0**-100  # exact: still a normal float32
  collapsed = halve(scale, 200)
  assert float(collapsed.loss_scale) == 0.0 and bool(collapsed.at_minimum)
  # At 0 the gradients of the scaled loss are 0 and unscale to NaN: every step is skipped.
  tx = jl.loss_scaling(optax.sgd(1.0), collapsed)
  params = {"w": jnp.array([1.0, 2.0])}
  state = tx.init(params)
  for _ in range(2):
    _, grads = jl.scaled_value_and_grad(lambda p: jnp.sum(p["w"] ** 2), state)(params)
    updates, state = tx.update(grads, state, params)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  assert int(state.skipped_steps) == 2 and float(state.loss_scale.loss_scale) == 0.0


def test_an_integer_floor_warns_with_jmps_message():
  for floor in (2, np.int64(2), jnp.asarray(2, jnp.int32)):
    with pytest.warns(UserWarning, match="^Expected floating type for min_loss_scale, got int32"):
      scale = jl.DynamicLossScale(jnp.float32(8.0), min_loss_scale=floor)
    assert scale.min_loss_scale == 2.0 and type(scale.min_loss_scale) is float
