"""16-bit parameters with jl.low_precision_params, against fp32 optax references."""

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl
from jmp_lite import _rounding

METHODS = ("nearest", "stochastic", "kahan", "split")
bf16 = jnp.bfloat16


def regression(n_params=(16, 4)):
  """A linear regression whose gradients are a function of the bf16 weights only."""
  x = jax.random.normal(jax.random.key(0), (128, n_params[0]))
  y = x @ (0.3 * jax.random.normal(jax.random.key(1), n_params))

  def loss(w):
    return jnp.mean(((x.astype(w.dtype) @ w).astype(jnp.float32) - y) ** 2)

  w0 = 0.1 * jax.random.normal(jax.random.key(2), n_params)
  return loss, w0


def train(tx, params, loss, steps):
  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


@pytest.mark.parametrize("method", METHODS)
def test_fp32_parameters_pass_through_to_the_inner_optimizer(method):
  params = {"w": jnp.linspace(-1, 1, 6, dtype=jnp.float32), "step": jnp.int32(3)}
  grads = {"w": jnp.linspace(0.5, -0.2, 6, dtype=jnp.float32), "step": jnp.int32(0)}
  reference = optax.adam(1e-2)
  tx = jl.low_precision_params(reference, method)
  state, ref_state = tx.init(params), reference.init(params)
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
    ref_updates, ref_state = reference.update(grads, ref_state, params)
    np.testing.assert_array_equal(updates["w"], ref_updates["w"])
    params = optax.apply_updates(params, updates)
  assert state.residual is None or state.residual == {"w": None, "step": None}
  assert int(state.steps) == 3 and int(state.rounded_away) == 0


def test_nearest_stores_the_fp32_step_rounded_to_nearest():
  params = 0.1 * jax.random.normal(jax.random.key(0), (32,))
  params = params.astype(bf16)
  grads = jax.random.normal(jax.random.key(1), (32,)).astype(bf16)
  inner = optax.adam(3e-3)
  tx = jl.low_precision_params(inner, "nearest")
  updates, state = tx.update(grads, tx.init(params), params)
  wide = params.astype(jnp.float32)
  ref_updates, ref_state = inner.update(grads.astype(jnp.float32), inner.init(wide), wide)
  new = optax.apply_updates(params, updates)
  assert new.dtype == bf16 and updates.dtype == jnp.float32
  np.testing.assert_array_equal(new, (wide + ref_updates).astype(bf16))
  np.testing.assert_array_equal(state.inner_state[0].mu, ref_state[0].mu)
  lost = (new == params) & (ref_updates != 0)
  assert int(state.rounded_away) == int(lost.sum())


def constant_steps(method, steps, size=4096, **kwargs):
  """`steps` SGD steps of +2^-12 on bf16 ones: each is an eighth of bf16's spacing at 1."""
  tx = jl.low_precision_params(optax.sgd(1.0), method, **kwargs)
  params = jnp.ones((size,), bf16)
  grads = jnp.full((size,), -(2.0**-12), jnp.float32)
  step = jax.jit(lambda p, s: tx.update(grads, s, p))
  state = tx.init(params)
  for _ in range(steps):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  return params, state


def test_nearest_loses_small_updates_and_counts_them():
  params, state = constant_steps("nearest", 24)
  assert bool(jnp.all(params == 1))
  assert int(state.rounded_away) == 4096  # every element, every step


def test_stochastic_rounding_keeps_small_updates_in_expectation():
  params, state = constant_steps("stochastic", 24, seed=3)
  target = 1 + 24 * 2.0**-12  # 1.00586
  values = params.astype(jnp.float32)
  steps = (values - 1) / 2.0**-7  # bf16's spacing in [1, 2)
  assert bool(jnp.all((steps >= 0) & (steps == jnp.round(steps))))
  # The mean of 4096 independent walks: its standard deviation is below 2^-7 / sqrt(4096).
  assert abs(float(values.mean()) - target) < 4 * 2.0**-7 / 64
  assert 0 < int(state.rounded_away) < 4096


@pytest.mark.parametrize("method", ["kahan", "split"])
def test_kahan_and_split_recover_exactly_what_round_to_nearest_loses(method):
  params, state = constant_steps(method, 24, size=8)
  # Multiples of 2^-12 near 1 are exact in fp32 and in the 16-bit compensation.
  np.testing.assert_array_equal(jl.master_params(params, state), np.full(8, 1 + 24 * 2.0**-12))
  np.testing.assert_array_equal(params.astype(jnp.float32), np.full(8, 1.0078125))


def test_split_matches_fp32_master_bit_for_bit_when_the_forward_reads_its_view():
  loss, w0 = regression()
  schedule = optax.cosine_decay_schedule(1e-3, 20, alpha=0.01)
  inner = optax.adamw(schedule, weight_decay=1e-2)
  tx = jl.low_precision_params(inner, "split")
  master = w0.astype(bf16).astype(jnp.float32)
  params = w0.astype(bf16)
  state, split_state = inner.init(master), tx.init(params)
  # Op by op: compiled, XLA fuses a multiply and an add into one FMA in some programs and not in
  # others, and the claim is about the optimizer's arithmetic, not about XLA's fusion.
  with jax.disable_jit():
    for _ in range(20):
      grads = jax.grad(loss)(_rounding.split_float32(master)[0]).astype(jnp.float32)
      updates, state = inner.update(grads, state, master)
      master = optax.apply_updates(master, updates)
      updates, split_state = tx.update(jax.grad(loss)(params), split_state, params)
      params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(
    np.asarray(jl.master_params(params, split_state)).view(np.uint32),
    np.asarray(master).view(np.uint32),
  )
  np.testing.assert_array_equal(params, _rounding.split_float32(master)[0])
  assert int(split_state.inexact) == 0


def test_round_to_nearest_stalls_as_the_learning_rate_decays_and_the_others_do_not():
  loss, w0 = regression()
  inner = optax.adamw(optax.cosine_decay_schedule(3e-3, 300, alpha=0.01), weight_decay=1e-2)
  reference = float(loss(train(inner, w0, loss, 300)[0]))  # fp32 parameters
  losses = {
    m: float(loss(train(jl.low_precision_params(inner, m), w0.astype(bf16), loss, 300)[0]))
    for m in METHODS
  }
  # Measured: nearest 1.30x the fp32 loss, stochastic 0.985x, kahan and split 1.0005x.
  assert losses["nearest"] > 1.2 * reference
  assert losses["kahan"] == pytest.approx(reference, rel=0.005)
  assert losses["split"] == pytest.approx(reference, rel=0.005)
  assert losses["stochastic"] == pytest.approx(reference, rel=0.05)


@pytest.mark.parametrize("method", ["nearest", "stochastic"])
def test_state_dtype_stores_the_moments_rounded_by_the_method(method):
  params = jnp.linspace(-1, 1, 64).astype(bf16)
  grads = jnp.linspace(0.3, -0.7, 64, dtype=jnp.float32)
  inner = optax.adam(1e-3)
  tx = jl.low_precision_params(inner, method, state_dtype="bfloat16")
  state = tx.init(params)
  adam_state = state.inner_state[0]
  assert adam_state.mu.dtype == bf16 and adam_state.nu.dtype == bf16
  assert adam_state.count.dtype == jnp.int32
  _, state = tx.update(grads, state, params)
  wide = params.astype(jnp.float32)
  _, ref = inner.update(grads, inner.init(wide), wide)
  for got, want in [(state.inner_state[0].mu, ref[0].mu), (state.inner_state[0].nu, ref[0].nu)]:
    assert got.dtype == bf16
    if method == "nearest":
      np.testing.assert_array_equal(got, want.astype(bf16))
    else:  # one of the two bf16 values around the fp32 moment
      nearest = want.astype(bf16)
      other = jnp.nextafter(nearest, jnp.where(want > nearest, jnp.inf, -jnp.inf).astype(bf16))
      assert bool(jnp.all((got == nearest) | (got == other)))
      assert bool(jnp.any(got != nearest))


def test_stochastic_with_fp32_state_dtype_keeps_the_fp32_moments():
  params, grads = jnp.linspace(-1, 1, 8).astype(bf16), jnp.linspace(0.3, -0.7, 8)
  inner = optax.adam(1e-3)
  tx = jl.low_precision_params(inner, "stochastic", state_dtype=jnp.float32)
  _, state = tx.update(grads, tx.init(params), params)
  wide = params.astype(jnp.float32)
  _, ref = inner.update(grads, inner.init(wide), wide)
  np.testing.assert_array_equal(state.inner_state[0].nu, ref[0].nu)


def run_stochastic(steps, seed=0, resume_at=None):
  loss, w0 = regression()
  tx = jl.low_precision_params(optax.sgd(1e-3), "stochastic", seed=seed, state_dtype=bf16)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  params, state = w0.astype(bf16), tx.init(w0.astype(bf16))
  for i in range(steps):
    if i == resume_at:  # a checkpoint: to host memory and back
      params, state = jax.tree.map(jnp.asarray, jax.device_get((params, state)))
    params, state = step(params, state)
  return params, state


def test_stochastic_rounding_is_reproducible_differs_per_step_and_resumes_bit_exactly():
  params, state = run_stochastic(6)
  again, _ = run_stochastic(6)
  resumed, resumed_state = run_stochastic(6, resume_at=3)
  other_seed, _ = run_stochastic(6, seed=1)
  np.testing.assert_array_equal(again, params)
  np.testing.assert_array_equal(resumed, params)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed_state), strict=True):
    np.testing.assert_array_equal(a, b)
  assert bool(jnp.any(other_seed != params))
  # The same parameters and gradients, one step later, round differently.
  tx = jl.low_precision_params(optax.sgd(1.0), "stochastic")
  p, g = jnp.ones((256,), bf16), jnp.full((256,), -(2.0**-9))
  first, state = tx.update(g, tx.init(p), p)
  second, _ = tx.update(g, state, p)
  assert bool(jnp.any(first != second))


def test_stochastic_rounding_takes_a_key_of_another_implementation():
  key = jax.random.key(5, impl="unsafe_rbg")
  tx = jl.low_precision_params(optax.sgd(1.0), "stochastic", seed=key)
  p = jnp.ones((64,), bf16)
  state = tx.init(p)
  assert state.key.shape == jax.random.key_data(key).shape == (4,)
  updates, _ = jax.jit(tx.update)(jnp.full((64,), -(2.0**-9)), state, p)
  assert set(np.unique(optax.apply_updates(p, updates).astype(jnp.float32))) == {1.0, 1.0078125}


# XLA:CPU's copy insertion that orders reads before writes by analysis (see
# docs/low-precision-params.md, "Step time").
REGION_ANALYSIS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def donated_step(tx, loss, **options):
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1), compiler_options={**REGION_ANALYSIS, **options})


def entry_computation(compiled) -> str:
  text = compiled.as_text()
  entry = text[text.index("ENTRY") :]
  return entry[: entry.index("\n}\n")]


@pytest.mark.parametrize("method", METHODS)
def test_a_step_that_donates_the_state_leaves_the_transformation_usable(method):
  loss, w0 = regression()
  tx = jl.low_precision_params(optax.adam(1e-2), method, state_dtype=bf16)
  params = w0.astype(bf16)
  step = donated_step(tx, loss)
  for _ in range(2):  # the second init once needed the key the first step's donation deleted
    state = tx.init(params)
    trained, state = step(jnp.copy(params), state)
    trained, state = step(trained, state)
  assert int(state.steps) == 2 and bool(jnp.any(trained != params))
  # Copy insertion changes which buffers XLA copies, not a value.
  expected, _ = train(tx, params, loss, 2)
  np.testing.assert_array_equal(np.asarray(trained, np.float32), np.asarray(expected, np.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's copy insertion")
@pytest.mark.parametrize("method", METHODS)
def test_a_donated_step_copies_no_donated_buffer_and_draws_once(method):
  # A copy of a donated parameter or moment is XLA guarding a read that comes after the write
  # of its new value; together they made the 2-core CPU step 1.15-1.35x slower.
  loss, w0 = regression()
  tx = jl.low_precision_params(optax.adam(1e-2), method, state_dtype=bf16)
  params = {"w": w0.astype(bf16), "scale": jnp.ones(4, bf16)}
  loss_of = lambda p: loss(p["w"] * p["scale"])
  state = tx.init(params)
  # Compiled as a training step is, not as the unit tier compiles (tests/conftest.py).
  optimized = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
  entry = entry_computation(donated_step(tx, loss_of, **optimized).lower(params, state).compile())
  # Copies of arrays of the donated parameters' and moments' types: XLA copied the new values
  # of the parameters (before: every parameter) when the updates rounded away were counted by
  # comparing with the value stored.
  types = set(re.findall(r"= (\w+\[\d[\d,]*\])\S* parameter\(", entry)) - {"u32[2]"}  # not the key
  copies = re.findall(r"= (\w+\[\d[\d,]*\])\S* copy\(", entry)
  low_halves = {"s16[16,4]", "s16[4]"} if method == "split" else set()
  assert types == {"bf16[16,4]", "bf16[4]"} | low_halves
  assert not [t for t in copies if t in types], copies
  # One Threefry call derives the step's key and one draws every array's seed: XLA:CPU runs
  # each as a loop (a call per array was a loop per array: 115 in the char-LM step).
  assert entry.count("to_apply=%while") == (2 if method == "stochastic" else 0)


class GradientDtypes:
  """An inner optimizer that records the dtypes of the gradients it is given."""

  def __init__(self):
    self.seen = []
    self.tx = optax.GradientTransformation(lambda p: optax.EmptyState(), self.update)

  def update(self, grads, state, params=None):
    self.seen.append(jax.tree.map(lambda g: g.dtype, grads))
    return jax.tree.map(lambda g: -g, grads), state


@pytest.mark.parametrize("method", METHODS)
def test_loss_scaling_around_it_passes_fp32_gradients_and_skips_cleanly(method):
  dtype = jnp.float16 if method != "split" else bf16
  recorder = GradientDtypes()
  tx = jl.loss_scaling(
    jl.low_precision_params(optax.chain(recorder.tx, optax.scale(1.0)), method),
    jl.DynamicLossScale(2.0**10),
  )
  params = {"w": jnp.linspace(-1, 1, 8).astype(dtype)}
  state = tx.init(params)
  # The true gradient 2^-20 is below fp16's normal range; the inner optimizer gets it in fp32.
  scaled = {"w": jnp.full((8,), 2.0**-10, dtype)}
  updates, state = tx.update(scaled, state, params)
  assert recorder.seen == [{"w": jnp.dtype(jnp.float32)}]
  if method in ("kahan", "split"):
    moved = jl.master_params(optax.apply_updates(params, updates), state)
    np.testing.assert_array_equal(moved["w"] - params["w"].astype(jnp.float32), -(2.0**-20))
  inner_before = jl.get_loss_scaling_state(state).inner_state
  bad = {"w": scaled["w"].at[3].set(jnp.inf)}
  updates, state = tx.update(bad, state, params)
  assert int(jl.get_loss_scaling_state(state).skipped_steps) == 1
  np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], params["w"])
  for a, b in zip(
    jax.tree.leaves(jl.get_loss_scaling_state(state).inner_state),
    jax.tree.leaves(inner_before),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)


def test_an_unexpressible_step_is_counted_and_kahan_keeps_what_is_lost():
  # The fp32 value 1.99806750 reads as bf16 2.0; its step to -2^-23 would need 25 bits, so
  # optax.apply_updates stores 0 instead. Found by a search over random steps.
  master = jnp.asarray([1.9980674982070923, 0.5], jnp.float32)
  step = jnp.asarray([-1.9980676174163818, 0.0], jnp.float32)
  high, low = _rounding.split_float32(master)
  tx = jl.low_precision_params(optax.sgd(1.0), "split")
  updates, state = tx.update(-step, tx.init(high)._replace(residual=low), high)
  new = optax.apply_updates(high, updates)
  assert float((master + step)[0]) == -(2.0**-23) and new.tolist() == [0.0, 0.5]
  assert int(state.inexact) == 1  # told, not silent
  # -0.0 stepping to -0.0 is stored as +0.0: the kept value must not rebuild a NaN.
  zero = jnp.asarray([-0.0], bf16)
  updates, state = tx.update(jnp.zeros(1), tx.init(zero), zero)
  assert jl.master_params(optax.apply_updates(zero, updates), state).tolist() == [0.0]
  # Kahan's compensation is computed from the value stored, so it holds what the step lost:
  # 2 - 2^-9 reads as bf16 2.0 and compensation -2^-9; its step to -2^-23 is lost the same way.
  tx = jl.low_precision_params(optax.sgd(1.0), "kahan")
  params = jnp.asarray([2.0], bf16)
  state = tx.init(params)._replace(residual=jnp.asarray([-(2.0**-9)], bf16))
  step = jnp.asarray([-(2.0**-23)], jnp.float32) - jl.master_params(params, state)
  updates, state = tx.update(-step, state, params)
  new = optax.apply_updates(params, updates)
  assert float(new[0]) != -(2.0**-23)
  assert float(jl.master_params(new, state)[0]) == -(2.0**-23)
  assert int(state.inexact) == 0


@pytest.mark.parametrize("method", METHODS)
def test_infinite_and_zero_parameters_stay_as_fp32_optax_keeps_them(method):
  # inf - lr * g is inf in fp32; the wrapper's step to it once was inf - inf = NaN.
  params = jnp.asarray([jnp.inf, -jnp.inf, 0.0, -0.0, 1.0], bf16)
  grads = jnp.asarray([1e-3, -1e-3, 0.0, 0.0, 1.0], jnp.float32)
  reference = optax.sgd(0.5)
  tx = jl.low_precision_params(reference, method)
  state = tx.init(params)
  expected = params.astype(jnp.float32)
  for _ in range(2):  # the second step reads what the first kept (Kahan's compensation)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, _ = reference.update(grads, reference.init(expected), expected)
    expected = optax.apply_updates(expected, ref_updates)
    np.testing.assert_array_equal(np.asarray(params, np.float32), np.asarray(expected))
    # The infinite values' nonzero updates changed nothing: rounded away.
    assert int(state.rounded_away) == 2 and int(state.inexact) == 0
  assert np.isfinite(np.asarray(jl.master_params(params, state), np.float32)[2:]).all()


def test_bad_input_is_refused():
  adam = optax.adam(1e-3)
  with pytest.raises(ValueError, match="method must be one of"):
    jl.low_precision_params(adam, "truncate")
  with pytest.raises(TypeError, match="GradientTransformation"):
    jl.low_precision_params(lambda g: g, "nearest")
  with pytest.raises(ValueError, match="state_dtype must be a floating dtype of at most 32"):
    jl.low_precision_params(adam, "nearest", state_dtype=jnp.float64)
  with pytest.raises(TypeError, match="seed"):
    jl.low_precision_params(adam, "stochastic", seed=1.5)
  with pytest.raises(TypeError, match="single typed PRNG key"):
    jl.low_precision_params(adam, "stochastic", seed=jax.random.split(jax.random.key(0)))
  tx = jl.low_precision_params(adam, "split")
  with pytest.raises(ValueError, match=r"\['b'\] is float16"):
    tx.init({"a": jnp.ones(2, bf16), "b": jnp.ones(2, jnp.float16)})
  tx = jl.low_precision_params(adam, "nearest")
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(jnp.ones(2), tx.init(jnp.ones(2, bf16)))
  with pytest.raises(ValueError, match="Found 0 low_precision_params states"):
    jl.master_params(jnp.ones(2), adam.init(jnp.ones(2)))


# The three ways of replicating a step, in one process: most of each case's time was the
# subprocess importing JAX and Flax, not the step.
REPLICAS = r"""
import json
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import jmp_lite as jl

tx = jl.low_precision_params(optax.sgd(1e-2), "stochastic", seed=7, state_dtype=jnp.bfloat16)
x = jax.random.normal(jax.random.key(0), (64, 16))  # 8 examples per device
y = x @ jax.random.normal(jax.random.key(1), (16, 4))
params = (0.1 * jax.random.normal(jax.random.key(2), (16, 4))).astype(jnp.bfloat16)
loss = lambda w, x, y: jnp.mean(((x.astype(w.dtype) @ w).astype(jnp.float32) - y) ** 2)

def step(w, state, x, y, axis_name=None):
  grads = jax.grad(loss)(w, x, y)
  if axis_name:
    grads = jax.lax.pmean(grads, axis_name)
  updates, state = tx.update(grads, state, w)
  return optax.apply_updates(w, updates), state

mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

def replicas(how):  # each device's copy of the parameters after 5 steps from a fresh state
  state = tx.init(params)
  if how == "jit":
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    w, state = jax.device_put((params, state), replicated)
    xs, ys = jax.device_put((x, y), rows)
    run = jax.jit(step)
    for _ in range(5):
      w, state = run(w, state, xs, ys)
    return [np.asarray(s.data, np.float32) for s in w.addressable_shards]
  if how == "shard_map":
    def per_device(w, state, x, y):
      for _ in range(5):
        w, state = step(w, state, x, y, "data")
      return w[None]  # each device's own copy, stacked
    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                out_specs=P("data"), check_vma=False))
    return list(np.asarray(run(params, state, x, y), np.float32))
  w, state = jax.tree.map(lambda a: jnp.stack([a] * 8), (params, state))
  run = jax.pmap(lambda w, s, x, y: step(w, s, x, y, "data"), axis_name="data")
  for _ in range(5):
    w, state = run(w, state, x.reshape(8, 8, 16), y.reshape(8, 8, 4))
  return list(np.asarray(w, np.float32))

single, one_state = params, tx.init(params)
for _ in range(5):
  single, one_state = jax.jit(step)(single, one_state, x, y)
out = {}
for how in ("jit", "shard_map", "pmap"):
  copies = replicas(how)
  out[how] = {
    "copies": len(copies),
    "identical": all(np.array_equal(c, copies[0]) for c in copies),
    "moved": bool(np.any(copies[0] != np.asarray(params, np.float32))),
    "max_vs_one_device": float(np.max(np.abs(copies[0] - np.asarray(single, np.float32)))),
  }
print(json.dumps(out))
"""


def test_stochastic_rounding_is_identical_on_every_replica(run_on_8_devices):
  results = run_on_8_devices("-c", textwrap.dedent(REPLICAS))
  assert sorted(results) == ["jit", "pmap", "shard_map"], results
  for how, out in results.items():
    assert out["copies"] == 8 and out["identical"] and out["moved"], (how, out)
    # The same noise as on one device: only the all-reduced gradients' rounding can differ.
    assert out["max_vs_one_device"] <= 2.0**-6, (how, out)
