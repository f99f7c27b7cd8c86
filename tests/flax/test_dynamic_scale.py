"""jmp_lite.flax.DynamicScale, side by side with flax.training.dynamic_scale.DynamicScale.

The specification is Flax's current upstream behaviour as its own unit tests state it (growth on
the ``growth_interval``-th consecutive finite step). Flax 0.12 grows one step later, i.e. like
upstream with ``growth_interval - 1``: the differential tests compare with the installed Flax
through that mapping (``_flax_interval``), and one test states the difference. Everything else
is compared exactly with the installed Flax, except the documented differences, each tested on
its own (docs/migrating-from-flax.md).
"""

import functools
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization, struct
from flax.training import dynamic_scale as flax_lib
from flax.training import train_state
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_lite.flax as jlf
from jmp_lite.flax import dynamic_scale as ours_lib

from .flax_testing import jit

F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)


def _square(p):
  return p**2


def _flax_grows_late() -> bool:
  """Whether the installed Flax grows on the (growth_interval + 1)-th finite step (Flax 0.12)."""
  ds = flax_lib.DynamicScale(growth_interval=1, scale=4.0)
  return float(ds.value_and_grad(_square)(1.0).dynamic_scale.scale) == 4.0


FLAX_GROWS_LATE = _flax_grows_late()


def _flax_interval(growth_interval: int) -> int:
  """The installed Flax's growth_interval that behaves like upstream's ``growth_interval``."""
  return growth_interval - 1 if FLAX_GROWS_LATE else growth_interval


def _scales(lib, inputs, **config):
  ds = lib.DynamicScale(**config)
  scales = []
  for p in inputs:
    ds, _, _, _ = ds.value_and_grad(_square)(p)
    scales.append(float(ds.scale))
  return scales


# ---------------------------------------------------------------------------------------------
# The scale rule: upstream's sequences exactly, and the installed Flax through the mapping.


def test_upstream_growth_sequence():
  # Flax's tests/dynamic_scale_test.py: test_grows_after_growth_interval_finite_steps.
  assert _scales(ours_lib, [1.0] * 6, growth_interval=3, scale=4.0) == [4, 4, 8, 8, 8, 16]


def test_upstream_backoff_sequence():
  # Flax's tests/dynamic_scale_test.py: test_non_finite_step_backs_off_and_restarts_count.
  inputs = [1.0, jnp.inf, 1.0, 1.0]
  assert _scales(ours_lib, inputs, growth_interval=2, scale=4.0) == [4, 2, 2, 4]


def test_installed_flax_grows_one_step_later():
  installed = _scales(flax_lib, [1.0] * 6, growth_interval=3, scale=4.0)
  backoff = _scales(flax_lib, [1.0, jnp.inf, 1.0, 1.0], growth_interval=2, scale=4.0)
  if FLAX_GROWS_LATE:  # Flax 0.12: the difference docs/migrating-from-flax.md states
    assert installed == [4, 4, 4, 8, 8, 8] and backoff == [4, 2, 2, 2]
  else:  # a Flax with upstream's rule: no difference left
    assert installed == [4, 4, 8, 8, 8, 16] and backoff == [4, 2, 2, 4]
  # Either way the installed Flax with _flax_interval(g) runs upstream's sequence.
  assert _scales(flax_lib, [1.0] * 6, growth_interval=_flax_interval(3), scale=4.0) == [
    4,
    4,
    8,
    8,
    8,
    16,
  ]


def test_fin_steps_from_a_late_growing_checkpoint_grows_on_the_next_finite_step():
  # Flax 0.12 can save fin_steps == growth_interval (it grows on the step after).
  ds = jlf.DynamicScale(growth_interval=3, scale=4.0, fin_steps=3)
  ds, is_fin, _, _ = ds.value_and_grad(_square)(1.0)
  assert bool(is_fin) and float(ds.scale) == 8.0 and int(ds.fin_steps) == 0


# Static configurations (each compiles once per implementation): (growth, backoff, minimum).
CONFIGS = [(2.0, 0.5, TINY), (4.0, 0.25, 1.0), (1.0, 0.5, 2.0**-3)]


@functools.cache
def _rule_step(lib, config, growth_interval):
  growth, backoff, minimum = config
  loss = lambda p: p * p

  @jit
  def step(scale, fin_steps, p):
    ds = lib.DynamicScale(growth, backoff, growth_interval, fin_steps, scale, minimum)
    ds, is_fin, value, grad = ds.value_and_grad(loss)(p)
    return ds.scale, ds.fin_steps, is_fin, value, grad

  return step


@settings(max_examples=12)
@given(
  config=st.sampled_from(CONFIGS),
  growth_interval=st.sampled_from([1, 3]),
  scale_exponent=st.integers(0, 20),
  fin_steps=st.integers(0, 2),
  finite=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_scale_rule_matches_installed_flax(
  config, growth_interval, scale_exponent, fin_steps, finite
):
  fin_steps = min(fin_steps, growth_interval - 1)
  ours_step = _rule_step(ours_lib, config, growth_interval)
  flax_step = _rule_step(flax_lib, config, _flax_interval(growth_interval))
  ours = flax = (jnp.float32(2.0**scale_exponent), jnp.int32(fin_steps))
  for fin in finite:
    p = jnp.float32(1.5 if fin else jnp.inf)
    ours_out, flax_out = ours_step(*ours[:2], p), flax_step(*flax[:2], p)
    for a, b in zip(ours_out, flax_out, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ours, flax = ours_out, flax_out
  assert float(ours[0]) >= config[2]


# ---------------------------------------------------------------------------------------------
# Values, gradients and is_fin: exact against the installed Flax, over generated data.


def _loss_f32(params, x):
  return jnp.sum((x * params["w"] + params["b"]) ** 2)


def _loss_f16_aux(params, x):
  h = jnp.asarray(x, jnp.float16) * jnp.asarray(params["w"], jnp.float16)
  loss = jnp.sum(jnp.asarray(h + params["b"].astype(jnp.float16), jnp.float32) ** 2)
  return loss, {"h": h}


def _loss_two_args(w, params, x):  # bf16 parameters, differentiated w.r.t. both arguments
  return jnp.sum((x * w.astype(jnp.float32) * params["w"].astype(jnp.float32)) ** 2)


CASES = {
  "f32": (_loss_f32, {}, jnp.float32),
  "f16_has_aux": (_loss_f16_aux, {"has_aux": True}, jnp.float32),
  "bf16_argnums_tuple": (_loss_two_args, {"argnums": (0, 1)}, jnp.bfloat16),
}


@functools.cache
def _value_step(lib, case):
  loss, options, _ = CASES[case]

  @jit
  def step(scale, args):
    ds = lib.DynamicScale(growth_interval=_flax_interval(2) if lib is flax_lib else 2, scale=scale)
    return ds.value_and_grad(loss, **options)(*args)

  return step


values = st.one_of(
  st.floats(-50, 50, width=32), st.sampled_from([np.inf, -np.inf, np.nan, 0.0, 1e-30])
)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=10)
@given(
  data=st.lists(values, min_size=7, max_size=7),
  scale_exponent=st.integers(-10, 24),
)
def test_values_grads_and_is_fin_match_installed_flax(case, data, scale_exponent):
  dtype = CASES[case][2]
  data = np.asarray(data, np.float32)
  params = {"w": jnp.asarray(data[:3], dtype), "b": jnp.asarray(data[3], dtype)}
  args = (params, jnp.asarray(data[4:]))
  if case == "bf16_argnums_tuple":
    args = (jnp.asarray(data[4:], dtype), params, jnp.asarray(data[4:]))
  # Flax's scale given strongly typed, as it is after its first step (see the weak-type test).
  scale = jnp.float32(2.0**scale_exponent)
  ours = _value_step(ours_lib, case)(scale, args)
  flax = _value_step(flax_lib, case)(scale, args)
  assert type(ours).__name__ == "DynamicScaleResult" and ours._fields == flax._fields
  np.testing.assert_array_equal(ours.finite, flax.finite)
  np.testing.assert_array_equal(ours.dynamic_scale.scale, flax.dynamic_scale.scale)
  np.testing.assert_array_equal(ours.dynamic_scale.fin_steps, flax.dynamic_scale.fin_steps)
  assert jax.tree.structure(ours.grad) == jax.tree.structure(flax.grad)
  for a, b in zip(jax.tree.leaves(ours.grad), jax.tree.leaves(flax.grad), strict=True):
    assert a.dtype == b.dtype == jnp.float32  # the unscale is in fp32, in both
    np.testing.assert_array_equal(a, b)
  # The value: ours is fun's own (its dtype), Flax's is (S * loss) / S; equal unless S * loss
  # overflows (it cannot at these magnitudes).
  for a, b in zip(jax.tree.leaves(ours.aux), jax.tree.leaves(flax.aux), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_float64_gradients_stay_float64():
  # Flax casts every gradient to float32, truncating float64 ones; ours keeps float64.
  loss = lambda p: jnp.sum(p * p)
  with jax.enable_x64(True):
    p = jnp.full(2, 1 + 2.0**-40, jnp.float64)
    ours, flax = jax.jit(
      lambda p: (
        jlf.DynamicScale(scale=4.0).value_and_grad(loss)(p).grad,
        flax_lib.DynamicScale(scale=4.0).value_and_grad(loss)(p).grad,
      )
    )(p)
    assert ours.dtype == jnp.float64 and flax.dtype == jnp.float32
    np.testing.assert_array_equal(ours, 2 * p)


# ---------------------------------------------------------------------------------------------
# Where Flax is weaker: each documented difference, stated against the installed Flax.


def test_scale_is_strongly_typed_float32_so_jit_compiles_once():
  loss = lambda p: jnp.sum(jnp.asarray(p, jnp.float16) ** 2)
  p = jnp.full(2, 0.25, jnp.float32)

  def run(lib):
    traces = []

    @jax.jit
    def step(ds, p):
      traces.append(1)
      return ds.value_and_grad(loss)(p)

    ds, finite, values = lib.DynamicScale(), [], []
    for _ in range(3):
      ds, is_fin, value, _ = step(ds, p)
      finite.append(bool(is_fin))
      values.append(float(value))
    return finite, values, len(traces)

  results = {"ours": run(ours_lib), "flax": run(flax_lib)}
  # 65536 overflows fp16 gradients in both (the first two steps back off). Flax's Python-float
  # default multiplies the fp16 loss in fp16, where 65536 is inf (value inf / inf = NaN), then
  # turns strongly typed after the first step, so the step compiles a second time.
  assert results["flax"][0] == results["ours"][0] == [False, False, True]
  assert np.isnan(results["flax"][1][0]) and results["flax"][1][1:] == [0.125, 0.125]
  assert results["ours"][1] == [0.125] * 3
  assert (results["ours"][2], results["flax"][2]) == (1, 2)


def test_scale_does_not_grow_to_float32_max():
  ours = jlf.DynamicScale(growth_interval=1, scale=2.0**127).value_and_grad(_square)(1e-30)
  flax = flax_lib.DynamicScale(growth_interval=_flax_interval(1), scale=jnp.float32(2.0**127))
  flax = flax.value_and_grad(_square)(1e-30)
  assert bool(ours.finite) and bool(flax.finite)
  assert float(flax.dynamic_scale.scale) == F32_MAX  # not a power of two
  assert float(ours.dynamic_scale.scale) == 2.0**127 and int(ours.dynamic_scale.fin_steps) == 0


def test_minimum_scale_none_floors_at_float32_tiny_instead_of_zero():
  start = jnp.float32(2.0**-125)
  ours = jlf.DynamicScale(scale=start, minimum_scale=None)
  flax = flax_lib.DynamicScale(scale=start, minimum_scale=None)
  overflow = jax.jit(lambda ds: ds.value_and_grad(_square)(jnp.float32(jnp.inf)).dynamic_scale)
  for _ in range(30):
    ours, flax = overflow(ours), overflow(flax)
  assert float(flax.scale) == 0.0
  assert float(ours.scale) == TINY
  # Flax's stays at 0 and every later step is skipped (0/0); ours recovers.
  assert not bool(flax.value_and_grad(_square)(1.0).finite)
  assert bool(ours.value_and_grad(_square)(1.0).finite)


def test_minimum_scale_is_a_floor_as_in_flax():
  ours = jlf.DynamicScale(scale=3.0, minimum_scale=2.0)
  flax = flax_lib.DynamicScale(scale=jnp.float32(3.0), minimum_scale=2.0)
  for _ in range(2):
    ours, *_ = ours.value_and_grad(_square)(jnp.inf)
    flax, *_ = flax.value_and_grad(_square)(jnp.inf)
    assert float(ours.scale) == float(flax.scale) == 2.0


def test_value_is_the_loss_even_when_the_scaled_loss_overflows():
  loss = lambda p: p * 1e34
  ours = jlf.DynamicScale().value_and_grad(loss)(jnp.float32(1.0))
  flax = flax_lib.DynamicScale(scale=jnp.float32(65536.0)).value_and_grad(loss)(jnp.float32(1.0))
  assert float(ours.aux) == np.float32(1e34) and float(flax.aux) == np.inf
  assert not bool(ours.finite) and not bool(flax.finite)  # the gradient overflows in both


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"growth_factor": 0.5}, ValueError, "growth_factor must be finite and >= 1, got 0.5"),
    ({"growth_factor": np.inf}, ValueError, "growth_factor must be finite and >= 1, got inf"),
    ({"growth_factor": "2"}, TypeError, "growth_factor must be a number >= 1, got '2'"),
    ({"backoff_factor": 1.0}, ValueError, r"backoff_factor must be in \(0, 1\), got 1.0"),
    ({"backoff_factor": 0.0}, ValueError, r"backoff_factor must be in \(0, 1\), got 0.0"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be >= 1, got 0"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int >= 1, got 2.5"),
    ({"scale": 0.0}, ValueError, "scale must be positive and finite, got 0.0"),
    ({"scale": -4.0}, ValueError, "scale must be positive and finite, got -4.0"),
    ({"scale": np.inf}, ValueError, "scale must be positive and finite, got inf"),
    ({"scale": jnp.ones(2)}, ValueError, r"scale must be a scalar, got shape \(2,\)"),
    ({"scale": 1.0, "minimum_scale": 2.0}, ValueError, "scale=1.0 is below minimum_scale=2.0"),
    ({"minimum_scale": 0.0}, ValueError, "minimum_scale must be positive and finite, got 0.0"),
    ({"minimum_scale": 1e-50}, ValueError, "minimum_scale=1e-50 is not representable"),
    ({"fin_steps": -1}, ValueError, "fin_steps must be >= 0, got -1"),
    ({"fin_steps": 1.0}, TypeError, "fin_steps must be an integer scalar, got 1.0"),
  ],
)
def test_bad_configuration_raises_naming_the_value(kwargs, error, match):
  with pytest.raises(error, match=match):
    jlf.DynamicScale(**kwargs)


def test_flax_compatible_defaults_and_accepted_values():
  ds = jlf.DynamicScale()
  flax = flax_lib.DynamicScale()
  for name in ("growth_factor", "backoff_factor", "growth_interval", "minimum_scale"):
    assert getattr(ds, name) == getattr(flax, name), name
  assert float(ds.scale) == flax.scale and int(ds.fin_steps) == flax.fin_steps
  assert ds.scale.dtype == jnp.float32 and not ds.scale.weak_type
  assert ds.fin_steps.dtype == jnp.int32 and not ds.fin_steps.weak_type
  assert jlf.DynamicScale(growth_interval=10.0, growth_factor=1).growth_interval == 10
  assert jlf.DynamicScale(scale=8).scale.dtype == jnp.float32  # an int scale, as Flax allows
  with pytest.raises(ValueError, match=r"scale must be positive and finite, got 0\.0"):
    ds.replace(scale=0.0)  # replace checks as the constructor does


def test_jit_traces_once_across_steps_and_dynamic_scales():
  traces = []

  @jax.jit
  def step(ds, p):
    traces.append(1)
    return ds.value_and_grad(_square)(p)

  ds = jlf.DynamicScale(growth_interval=1, scale=4.0)
  for p in [1.0, jnp.inf, 1.0]:
    ds, *_ = step(ds, jnp.float32(p))
  ds, *_ = step(jlf.DynamicScale(growth_interval=1, scale=2.0**-3, fin_steps=5), jnp.float32(1))
  assert len(traces) == 1 and float(ds.scale) == 2.0**-2


def test_pytree_roles_match_flax():
  ours, flax = jlf.DynamicScale(), flax_lib.DynamicScale()
  ours_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(ours)[0]]
  flax_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(flax)[0]]
  assert (
    ours_paths == flax_paths == [(jax.tree_util.GetAttrKey(n),) for n in ("fin_steps", "scale")]
  )
  # Unflattening skips validation (placeholders from tree utilities pass through).
  assert jax.tree.map(lambda _: None, ours).scale is None


# ---------------------------------------------------------------------------------------------
# Checkpoints: a Flax DynamicScale restores into ours and back, with flax.serialization and orbax.


class _FlaxState(struct.PyTreeNode):  # a user's state holding a DynamicScale field
  params: dict
  dynamic_scale: object


def _stepped(lib, steps=3):
  ds = lib.DynamicScale(growth_interval=_flax_interval(5) if lib is flax_lib else 5, scale=8.0)
  for _ in range(steps):
    ds, *_ = ds.value_and_grad(_square)(jnp.float32(1.0))
  return ds


@pytest.mark.parametrize("direction", ["flax_to_ours", "ours_to_flax"])
def test_flax_serialization_round_trip(direction):
  source_lib, target_lib = (
    (flax_lib, ours_lib) if direction == "flax_to_ours" else (ours_lib, flax_lib)
  )
  source = _FlaxState({"w": jnp.ones(2)}, _stepped(source_lib))
  target = _FlaxState({"w": jnp.zeros(2)}, target_lib.DynamicScale())
  assert serialization.to_state_dict(source)["dynamic_scale"].keys() == {"fin_steps", "scale"}
  restored = serialization.from_bytes(target, serialization.to_bytes(source))
  assert type(restored.dynamic_scale) is target_lib.DynamicScale
  assert int(restored.dynamic_scale.fin_steps) == 3 and float(restored.dynamic_scale.scale) == 8.0
  np.testing.assert_array_equal(restored.params["w"], np.ones(2))
  with pytest.raises(ValueError, match="keys"):
    serialization.from_state_dict(jlf.DynamicScale(), {"scale": 1.0})


@pytest.mark.parametrize("direction", ["flax_to_ours", "ours_to_flax"])
def test_orbax_round_trip(direction, tmp_path):
  source_lib, target_lib = (
    (flax_lib, ours_lib) if direction == "flax_to_ours" else (ours_lib, flax_lib)
  )
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(
    tmp_path / "ckpt", {"dynamic_scale": _stepped(source_lib), "step": jnp.int32(3)}
  )
  checkpointer.wait_until_finished()
  target = {"dynamic_scale": target_lib.DynamicScale(), "step": jnp.int32(0)}
  restored = checkpointer.restore(tmp_path / "ckpt", target)["dynamic_scale"]
  assert type(restored) is target_lib.DynamicScale
  assert int(restored.fin_steps) == 3 and float(restored.scale) == 8.0


# ---------------------------------------------------------------------------------------------
# select, and a Flax training step that switches by its import alone.


def test_select_matches_flax_where_pattern_and_keeps_the_new_dynamic_scale():
  old = {"params": {"w": jnp.ones(3)}, "count": jnp.int32(4), "ds": jlf.DynamicScale(scale=8.0)}
  new = {
    "params": {"w": jnp.full(3, 2.0)},
    "count": jnp.int32(5),
    "ds": jlf.DynamicScale(scale=4.0),
  }
  for is_fin in (True, False):
    got = jlf.DynamicScale.select(jnp.array(is_fin), new, old)
    flax_pattern = jax.tree.map(functools.partial(jnp.where, is_fin), new["params"], old["params"])
    np.testing.assert_array_equal(got["params"]["w"], flax_pattern["w"])
    assert int(got["count"]) == (5 if is_fin else 4)
    assert got["ds"] is new["ds"]  # the scale moves on a skipped step too
  with pytest.raises(TypeError, match="is_fin must be a boolean scalar"):
    jlf.DynamicScale.select(1, new, old)


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(3)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return jnp.sum(nn.Dense(1)(x))


class _TrainState(train_state.TrainState):  # Flax's ImageNet example's state
  batch_stats: dict
  dynamic_scale: object


def _flax_imagenet_step(dynamic_scale_lib, state, x):
  """Flax's ImageNet train step, its DynamicScale module passed in (the one import)."""

  def loss_fn(params):
    out, updates = state.apply_fn(
      {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
    )
    return out**2, updates

  dynamic_scale = state.dynamic_scale
  assert isinstance(dynamic_scale, dynamic_scale_lib.DynamicScale)
  grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True)
  dynamic_scale, is_fin, (loss, updates), grads = grad_fn(state.params)
  new_state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
  where = functools.partial(jnp.where, is_fin)
  new_state = new_state.replace(
    opt_state=jax.tree.map(where, new_state.opt_state, state.opt_state),
    params=jax.tree.map(where, new_state.params, state.params),
    dynamic_scale=dynamic_scale,
  )
  return new_state, loss, is_fin


def test_flax_imagenet_step_switches_by_its_import_and_select_also_keeps_batch_stats():
  model = _Net()
  x = jnp.arange(8.0).reshape(4, 2) / 8
  variables = model.init(jax.random.key(0), x)
  runs = {}
  for name, lib in (("flax", flax_lib), ("ours", ours_lib)):
    interval = _flax_interval(2) if lib is flax_lib else 2
    state = _TrainState.create(
      apply_fn=model.apply,
      params=variables["params"],
      tx=optax.sgd(0.1),
      batch_stats=variables["batch_stats"],
      dynamic_scale=lib.DynamicScale(growth_interval=interval, scale=jnp.float32(2.0**10)),
    )
    step = jit(functools.partial(_flax_imagenet_step, lib))
    runs[name] = [state]
    for batch in (x, x.at[0, 0].set(jnp.inf), x):
      state, _, _ = step(state, batch)
      runs[name].append(state)
  for ours, flax in zip(runs["ours"], runs["flax"], strict=True):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax), strict=True):
      np.testing.assert_array_equal(a, b)
  # Flax's pattern lets the skipped step's NaN batch statistics through; select keeps them.
  skipped = runs["ours"][2]
  assert not all(bool(jnp.isfinite(s).all()) for s in jax.tree.leaves(skipped.batch_stats))
  kept = jlf.DynamicScale.select(jnp.array(False), skipped, runs["ours"][1])
  assert kept.dynamic_scale is skipped.dynamic_scale
  before = runs["ours"][1].batch_stats
  for a, b in zip(jax.tree.leaves(kept.batch_stats), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# axis_name: under the same pmap on 8 devices, ours and Flax's agree (one process, one step).

PMAP = """
import json
import functools
import jax, jax.numpy as jnp, numpy as np
from flax.training import dynamic_scale as flax_lib
from jmp_lite.flax import dynamic_scale as ours_lib

assert jax.device_count() == 8

def loss(params, x, y):  # x feeds only w's gradient, y only b's
  return jnp.mean((x @ params["w"]) ** 2) + jnp.mean((params["b"] * y) ** 2)

params = {"w": jnp.linspace(-1, 1, 3), "b": jnp.float32(0.5)}
rng = np.random.default_rng(0)
# Two scenarios (vmapped inside the pmap): all finite; an inf in device 3's x only.
x = rng.normal(size=(8, 2, 4, 3)).astype(np.float32)
x[3, 1, 0, 0] = np.inf
y = rng.normal(size=(8, 2, 4)).astype(np.float32)

def both(x, y):
  out = {}
  for name, lib in (("ours", ours_lib), ("flax", flax_lib)):
    ds = lib.DynamicScale(growth_interval=1000, scale=jnp.float32(2.0 ** 12))
    grad_fn = ds.value_and_grad(loss, axis_name="batch")
    ds, is_fin, value, grads = jax.vmap(lambda x, y: grad_fn(params, x, y))(x, y)
    out[name] = {"is_fin": is_fin, "scale": ds.scale, "value": value, "w": grads["w"],
                 "b": grads["b"]}
  return out

out = jax.pmap(both, axis_name="batch")(x, y)
out = jax.tree.map(lambda a: np.asarray(a, np.float64).tolist(), out)
# The single-device reference for b's gradient: the mean over devices of each device's gradient.
per_device = jax.vmap(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)), in_axes=(None, 0, 0))(
  params, x, y)["b"]
out["reference_b"] = np.asarray(jnp.mean(per_device, axis=0), np.float64).tolist()
print(json.dumps(out))
"""


def test_axis_name_averages_and_agrees_like_flax_under_pmap(run_on_8_devices):
  out = run_on_8_devices("-c", textwrap.dedent(PMAP))
  ours, flax = out["ours"], out["flax"]
  for key in ("is_fin", "scale", "value", "b"):
    np.testing.assert_array_equal(ours[key], flax[key], err_msg=key)
  np.testing.assert_array_equal(np.isfinite(ours["w"]), np.isfinite(flax["w"]))
  # Every device, both scenarios: finite, then skipped (device 3's inf reaches all 8).
  assert np.asarray(ours["is_fin"]).tolist() == [[True, False]] * 8
  assert np.asarray(ours["scale"]).tolist() == [[2.0**12, 2.0**11]] * 8
  # b's gradient is finite in both scenarios and is the average over devices.
  b = np.asarray(ours["b"])
  assert np.all(b == b[:1]) and np.all(np.isfinite(b))
  np.testing.assert_allclose(b[0], out["reference_b"], rtol=1e-6)
  np.testing.assert_array_equal(np.isfinite(ours["w"]), [[[True] * 3, [False] * 3]] * 8)


def test_a_dynamic_scale_built_after_a_donated_step_has_buffers_of_its_own():
  @functools.partial(jax.jit, donate_argnums=0)
  def step(ds):
    return ds.value_and_grad(_square)(jnp.float32(1.0)).dynamic_scale

  scale = jnp.float32(2.0**10)
  first = ours_lib.DynamicScale(growth_interval=1, scale=scale)
  restored = serialization.from_state_dict(first, serialization.to_state_dict(first))
  narrower = first.replace(growth_interval=2)
  assert float(step(first).scale) == 2.0**11
  assert first.scale.is_deleted()  # the step did consume it
  # Built from the same array, restored from its state dict, or replaced: not consumed with it.
  assert float(scale) == 2.0**10
  for ds in (ours_lib.DynamicScale(growth_interval=1, scale=scale), restored):
    assert float(step(ds).scale) == 2.0**11
  assert (float(narrower.scale), int(narrower.fin_steps)) == (2.0**10, 0)
  grown = step(narrower)
  assert (float(grown.scale), int(grown.fin_steps)) == (2.0**10, 1)
