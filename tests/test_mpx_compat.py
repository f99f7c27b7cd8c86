"""jmp_lite against MPX 0.1.8 (``mixed-precision-for-jax``), feature by feature, on Equinox.

Where MPX is right, jmp_lite's counterpart gives the same result, bit for bit where the
programs are the same: its casts, ``force_full_precision`` on fp16, the dynamic loss scale's
trajectory, ``filter_value_and_grad`` and ``optimizer_update`` on a ViT-style block (the
model MPX's examples train). Where MPX is wrong, a test shows MPX's behaviour, read from its
source and run, next to jmp_lite's (docs/equinox-haiku.md, "Against MPX"):

- it unscales the gradients with the scale already adjusted for the next step: on a growth
  step they come out halved (and the loss with them), on an overflow step doubled;
- it casts the loss scale to fp16: a scale above 65504 is inf, and an fp16 loss of 2.0 times
  a scale of 2^15 (or 65504, the largest it lets the scale grow to) overflows;
- ``set_half_precision_datatype`` ignores strings: ``"bfloat16"`` leaves fp16.

The tests that need no MPX (jmp_lite's filtered value-and-grad under ``jl.autocast`` and a
dynamic loss scale) run without it; the others take the ``mpx`` fixture, which skips them.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
FP16_POLICY = jl.get_policy("params=float32,compute=float16,output=float32")


@pytest.fixture
def mpx():
  mpx = pytest.importorskip(
    "mpx", reason="MPX (mixed-precision-for-jax==0.1.8, in the test extra) is not installed"
  )
  assert mpx.__version__ == "0.1.8", "these tests read MPX 0.1.8's behaviour"
  yield mpx
  mpx._dtypes.HALF_PRECISION_DATATYPE = F16  # MPX's default; a test may have changed it


def assert_bitwise_equal(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    if not eqx.is_array(x):  # a module's functions
      assert x is y
      continue
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def rel_err(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


class Block(eqx.Module):
  """A ViT-style block: patch embedding, LayerNorm, attention, MLP, mean-pooled head."""

  embed: eqx.nn.Linear
  norm1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP
  head: eqx.nn.Linear

  def __init__(self, key, d=8, patch=4, classes=10):
    k = jax.random.split(key, 4)
    self.embed = eqx.nn.Linear(patch, d, key=k[0])
    self.norm1, self.norm2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
    self.attn = eqx.nn.MultiheadAttention(2, d, key=k[1])
    self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, activation=jax.nn.gelu, key=k[2])
    self.head = eqx.nn.Linear(d, classes, key=k[3])

  def __call__(self, x):  # x: (tokens, patch)
    h = jax.vmap(self.embed)(x)
    n = jax.vmap(self.norm1)(h)
    h = h + self.attn(n, n, n)
    h = h + jax.vmap(self.mlp)(jax.vmap(self.norm2)(h))
    return self.head(h.mean(0))


def loss_fn(model, x, y):
  logits = jax.vmap(model)(x).astype(F32)  # the loss in fp32, as MPX's examples compute it
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


MODEL = Block(jax.random.key(0))
X, Y = jax.random.normal(jax.random.key(1), (4, 6, 4)), jnp.arange(4) % 10


@functools.cache
def fp32_reference():
  """(loss, gradients) of the fp32 block: the reference (jitted once: eager is 5x slower)."""
  return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(MODEL, X, Y)


def floats(model):
  return eqx.filter(model, eqx.is_inexact_array)


def jl_pure_cast_loss(model, x, y):
  """What MPX's filter_value_and_grad differentiates: every float input cast to fp16."""
  return loss_fn(*FP16_POLICY.cast_to_compute((model, x)), y)


@eqx.filter_jit
def mpx_value_and_grad(model, scaling, x, y):
  import mpx

  return (
    mpx.calculate_scaled_grad(loss_fn, scaling)(model, x, y),
    mpx.filter_value_and_grad(loss_fn, scaling)(model, x, y),
  )


@eqx.filter_jit
def jl_value_and_grad(model, loss_scale, x, y, cast=True):
  loss, scaled = jl.scaled_value_and_grad(
    jl_pure_cast_loss if cast else loss_fn, loss_scale, value_and_grad=eqx.filter_value_and_grad
  )(model, x, y)
  return loss, scaled, loss_scale.unscale_and_adjust(scaled, floats(model))


# jmp_lite's filtered value-and-grad for an Equinox module, under jl.autocast (no MPX needed).
def autocast_loss(policy):
  forward = jl.autocast(lambda model, x: jax.vmap(model)(x), policy)
  return lambda model, x, y: optax.softmax_cross_entropy_with_integer_labels(
    forward(model, x), y
  ).mean()


@pytest.mark.parametrize(
  "policy, loss_scale, tolerance",
  [
    ("params=float32,compute=float16,output=float32", jl.DynamicLossScale(F32(2**15)), 2**-7),
    ("params=float32,compute=bfloat16,output=float32", jl.NoOpLossScale(), 2**-4),
  ],
)
def test_autocast_filtered_gradients_are_the_fp32_ones_within_16_bit_noise(
  policy, loss_scale, tolerance
):
  want_loss, want = fp32_reference()
  loss, scaled = eqx.filter_jit(
    jl.scaled_value_and_grad(
      autocast_loss(policy), loss_scale, value_and_grad=eqx.filter_value_and_grad
    )
  )(MODEL, X, Y)
  grads, finite, _ = loss_scale.unscale_and_adjust(scaled, floats(MODEL))
  assert bool(finite) and loss.dtype == F32
  assert abs(float(loss) - float(want_loss)) < tolerance * float(want_loss)
  # The module's structure: its functions and integers are not differentiated (None).
  assert jax.tree.structure(grads) == jax.tree.structure(floats(MODEL))
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    assert g.dtype == F32 and rel_err(g, w) < tolerance  # fp16 measured < 2^-8, bf16 < 2^-5


def test_autocast_step_with_an_inf_gradient_is_skipped_and_the_module_unchanged():
  tx = jl.loss_scaling(optax.sgd(0.1), jl.DynamicLossScale(F32(2**15)))
  loss = autocast_loss(FP16_POLICY)

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    _, grads = jl.scaled_value_and_grad(loss, opt_state, value_and_grad=eqx.filter_value_and_grad)(
      model, x, y
    )
    updates, opt_state = tx.update(grads, opt_state, floats(model))
    return eqx.apply_updates(model, updates), opt_state

  state = tx.init(floats(MODEL))
  # 1e5 is past fp16's 65504: the input cast to fp16 is inf, and so are the gradients.
  model, state = step(MODEL, state, X.at[0, 0, 0].set(1e5), Y)
  assert_bitwise_equal(floats(model), floats(MODEL))
  ls = jl.get_loss_scaling_state(state)
  assert (int(ls.steps), int(ls.skipped_steps), float(ls.loss_scale.loss_scale)) == (1, 1, 2**14)
  # The next, finite step is applied: SGD's update is the fp32 gradient within fp16 noise.
  model, state = step(model, state, X, Y)
  want = fp32_reference()[1]
  moved = jax.tree.map(lambda a, b: (b - a) / 0.1, floats(model), floats(MODEL))
  for m, w in zip(jax.tree.leaves(moved), jax.tree.leaves(want), strict=True):
    assert rel_err(m, w) < 2**-7
  assert int(jl.get_loss_scaling_state(state).skipped_steps) == 1


# Where MPX is right: the same results.
def test_cast_tree_and_its_helpers_are_policy_casts(mpx):
  tree = {
    "w": jnp.linspace(-3, 3, 5, dtype=F32) / 3,
    "h": jnp.ones(2, F16) / 3,
    "b": jnp.ones(2, BF16) / 3,
    "n": jnp.arange(3),
    "act": jax.nn.relu,
  }
  for dtype in (F16, BF16, F32):
    assert_bitwise_equal(
      mpx.cast_tree(tree, dtype), jl.Policy(dtype, dtype, dtype).cast_to_compute(tree)
    )
    assert mpx.cast_tree(tree, dtype)["act"] is jax.nn.relu
  assert_bitwise_equal(mpx.cast_to_float32(tree), jl.cast_to_full(tree))
  assert_bitwise_equal(mpx.cast_to_full_precision(tree), jl.cast_to_full(tree))
  assert_bitwise_equal(mpx.cast_to_float16(tree), jl.get_policy("float16").cast_to_compute(tree))
  assert_bitwise_equal(mpx.cast_to_bfloat16(tree), jl.get_policy("bfloat16").cast_to_compute(tree))
  # MPX's "half" is a global (fp16 by default); jmp_lite's is the platform's (bf16 on CPU).
  assert_bitwise_equal(mpx.cast_to_half_precision(tree), FP16_POLICY.cast_to_compute(tree))
  assert jl.cast_to_half(tree)["w"].dtype == BF16
  # MPX casts fp16, bf16 and fp32 leaves only; jmp_lite every floating one (an fp64 NumPy array).
  wide = {"x": np.ones(2, np.float64)}
  assert mpx.cast_tree(wide, F16)["x"].dtype == np.float64
  assert FP16_POLICY.cast_to_compute(wide)["x"].dtype == np.float16
  # On a module: the arrays are cast, the functions and integers kept.
  assert_bitwise_equal(mpx.cast_tree(MODEL, F16), FP16_POLICY.cast_to_compute(MODEL))
  # The largest finite values MPX names.
  assert float(mpx.FLOAT16_MAX) == jl.format_info("float16").max == 65504.0
  assert float(mpx.BFLOAT16_MAX) == jl.format_info("bfloat16").max


def test_cast_function_is_a_compute_then_output_cast(mpx):
  f = lambda x, y: (jnp.exp(x) @ y, x.sum())
  args = (jnp.linspace(0, 1, 6).reshape(2, 3), jnp.ones((3, 2)) / 3)
  want = FP16_POLICY.cast_to_output(f(*FP16_POLICY.cast_to_compute(args)))
  assert_bitwise_equal(mpx.cast_function(f, F16, F32)(*args), want)
  # A result that is not a tuple or an array (a dict, a list) is returned uncast by MPX;
  # the policy's output cast casts any pytree.
  g = lambda x: {"y": x * 2}
  assert mpx.cast_function(g, F16, F32)(args[0])["y"].dtype == F16
  assert FP16_POLICY.cast_to_output(g(*FP16_POLICY.cast_to_compute(args[:1])))["y"].dtype == F32


def test_force_full_precision_is_full_precision_on_fp16_not_on_bf16(mpx):
  x = jnp.linspace(-4, 4, 7)
  softmax = lambda x: jax.nn.softmax(x * 3)
  want = softmax(x.astype(F16).astype(F32))  # fp32 arithmetic on the fp16 input
  for dtype, mpx_dtype in ((F16, F16), (BF16, F16)):
    given = x.astype(dtype)
    ours, theirs = jl.full_precision(softmax)(given), mpx.force_full_precision(softmax)(given)
    assert ours.dtype == dtype and theirs.dtype == mpx_dtype  # MPX: fp16 whatever it was given
    np.testing.assert_array_equal(ours, softmax(given.astype(F32)).astype(dtype))
  np.testing.assert_array_equal(mpx.force_full_precision(softmax)(x.astype(F16)), want.astype(F16))


def test_dynamic_loss_scale_trajectory_is_the_same_below_65504(mpx):
  theirs = mpx.DynamicLossScaling(F32(2**10), F32(2**7), factor=2, period=3)
  ours = jl.DynamicLossScale(F32(2**10), period=3, factor=2, min_loss_scale=2.0**7)
  finite = [1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1]
  seen = []
  for f in finite:
    theirs, ours = theirs.adjust(jnp.bool_(f)), ours.adjust(jnp.bool_(f))
    assert float(theirs.loss_scaling) == float(ours.loss_scale)
    assert int(theirs.counter) == int(ours.counter)
    seen.append(float(ours.loss_scale))
  # Grown after 3 finite steps, halved on each overflow, floored at 2^7: exact powers of two.
  assert seen[:12] == [2**10, 2**10, 2**11, 2**10, 2**10, 2**10, 2**9, 2**8, 2**7, 2**7, 2**7, 2**7]
  assert seen[-3:] == [2**9, 2**9, 2**9]


def test_dynamic_loss_scale_grows_past_mpx_clip(mpx):
  # MPX clips the scale at fp16's 65504 (its scale is cast to fp16); jmp_lite's stays a power
  # of two, with max_loss_scale= for a cap.
  grow = jnp.bool_(True)
  assert (
    float(mpx.DynamicLossScaling(F32(2**15), F32(1), period=1).adjust(grow).loss_scaling) == 65504
  )
  assert float(jl.DynamicLossScale(F32(2**15), period=1).adjust(grow).loss_scale) == 2**16
  capped = jl.DynamicLossScale(F32(2**15), period=1, max_loss_scale=2**15)
  assert float(capped.adjust(grow).loss_scale) == 2**15


def test_all_finite_and_select_tree_are_the_same(mpx):
  trees = [
    {"a": jnp.ones(3), "b": jnp.ones(2, F16)},
    {"a": jnp.array([1.0, jnp.inf]), "b": jnp.ones(2, F16)},
    {"a": jnp.ones(3), "b": jnp.array([jnp.nan], BF16)},
    {},
  ]
  for tree in trees:
    assert bool(mpx.all_finite(tree)) == bool(jl.all_finite(tree))
  a, b = floats(MODEL), jax.tree.map(jnp.zeros_like, floats(MODEL))
  for pred in (jnp.bool_(True), jnp.bool_(False)):
    assert_bitwise_equal(mpx.select_tree(pred, a, b), jl.select_tree(pred, a, b))


def test_filter_value_and_grad_is_scaled_value_and_grad_bit_for_bit(mpx):
  """A finite step that does not grow the scale, on the ViT block in fp16 (MPX's pure casts)."""
  scale = 2.0**10
  (scaled_value, mpx_scaled), (value, mpx_scale, mpx_finite, mpx_grads) = mpx_value_and_grad(
    MODEL, mpx.DynamicLossScaling(F32(scale), F32(1)), X, Y
  )
  loss, scaled, (grads, finite, next_scale) = jl_value_and_grad(
    MODEL, jl.DynamicLossScale(F32(scale)), X, Y
  )
  assert bool(mpx_finite) and bool(finite)
  assert float(mpx_scale.loss_scaling) == float(next_scale.loss_scale) == scale
  assert float(value) == float(loss) and float(scaled_value) == float(loss) * scale
  # MPX differentiates fp16 copies of the parameters, jmp_lite the fp32 ones through the
  # cast: the same fp16 cotangents, cast to fp32.
  assert_bitwise_equal(mpx.cast_to_float32(eqx.filter(mpx_scaled, eqx.is_array)), scaled)
  assert_bitwise_equal(eqx.filter(mpx_grads, eqx.is_array), grads)
  assert jax.tree.structure(grads) == jax.tree.structure(floats(MODEL))


def test_optimizer_update_is_loss_scaling_and_apply_updates(mpx):
  optimizer = optax.adam(1e-2)
  scale = 2.0**10
  _, (_, _, mpx_finite, mpx_grads) = mpx_value_and_grad(
    MODEL, mpx.DynamicLossScaling(F32(scale), F32(1)), X, Y
  )
  _, scaled, _ = jl_value_and_grad(MODEL, jl.DynamicLossScale(F32(scale)), X, Y)
  tx = jl.loss_scaling(optimizer, jl.DynamicLossScale(F32(scale)))

  @eqx.filter_jit
  def ours(model, opt_state, scaled):
    updates, opt_state = tx.update(scaled, opt_state, floats(model))
    return eqx.apply_updates(model, updates), opt_state

  theirs = eqx.filter_jit(mpx.optimizer_update)
  mpx_state, state = optimizer.init(floats(MODEL)), tx.init(floats(MODEL))
  mpx_model, mpx_state = theirs(MODEL, optimizer, mpx_state, mpx_grads, mpx_finite)
  model, state = ours(MODEL, state, scaled)
  assert_bitwise_equal(floats(mpx_model), floats(model))
  assert_bitwise_equal(mpx_state, jl.get_loss_scaling_state(state).inner_state)
  # A step with an inf gradient: both keep the module and the optimizer state.
  poisoned = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), scaled)
  mpx_model2, mpx_state2 = theirs(mpx_model, optimizer, mpx_state, poisoned, jnp.bool_(False))
  model2, state2 = ours(model, state, poisoned)
  assert_bitwise_equal(floats(mpx_model2), floats(mpx_model))
  assert_bitwise_equal(floats(model2), floats(model))
  assert_bitwise_equal(jl.get_loss_scaling_state(state2).inner_state, mpx_state2)


# Where MPX is wrong: its behaviour, and jmp_lite's.
def test_mpx_unscales_with_the_adjusted_scale(mpx):
  """(a) MPX's filter_value_and_grad adjusts the scale, then unscales with the new one."""
  f = lambda w, x: jnp.sum(w * x)  # d/dw = x; exact in fp16 for these values
  w, x = jnp.ones(4), jnp.array([1.0, 2.0, 3.0, 4.0])
  # A growth step (period 1): the gradients were scaled by 2^10 and are divided by 2^11.
  value, scaling, finite, grads = mpx.filter_value_and_grad(
    f, mpx.DynamicLossScaling(F32(2**10), F32(1), period=1)
  )(w, x)
  assert bool(finite) and float(scaling.loss_scaling) == 2**11
  np.testing.assert_array_equal(grads, x / 2)
  assert float(value) == 10.0 / 2
  # Growing from 2^15, MPX's clip makes the new scale 65504: the gradients come out 2^15/65504.
  small = jnp.array([0.25, 0.5, 1.0, 1.5])  # times 2^15: finite in fp16
  _, _, finite, grown = mpx.filter_value_and_grad(
    f, mpx.DynamicLossScaling(F32(2**15), F32(1), period=1)
  )(w, small)
  assert bool(finite)
  want = (2**15 * np.asarray(small, np.float32)) * np.float32(1 / 65504)
  np.testing.assert_array_equal(grown, want)  # 0.50002 x the true gradients
  # So an SGD step (lr 1) through MPX's optimizer_update moves the parameters half as far.
  updated, _ = mpx.optimizer_update(w, optax.sgd(1.0), optax.sgd(1.0).init(w), grads, finite)
  np.testing.assert_array_equal(updated, w - x / 2)
  ours = jl.DynamicLossScale(F32(2**10), period=1)
  loss, scaled = jl.scaled_value_and_grad(
    lambda w, x: f(*FP16_POLICY.cast_to_compute((w, x))), ours
  )(w, x)
  true, finite, following = ours.unscale_and_adjust(scaled, w)
  assert bool(finite) and float(following.loss_scale) == 2**11
  np.testing.assert_array_equal(true, x)
  assert float(loss) == 10.0
  # An overflow step: 2^10 * 64 overflows fp16; the finite gradients come out doubled (the
  # step is skipped, so they are not applied), and the loss is inf (its fp16 scaled value).
  x = jnp.array([1.0, 2.0, 3.0, 64.0])
  value, scaling, finite, grads = mpx.filter_value_and_grad(
    f, mpx.DynamicLossScaling(F32(2**10), F32(1))
  )(w, x)
  assert not bool(finite) and float(scaling.loss_scaling) == 2**9
  np.testing.assert_array_equal(grads, [2.0, 4.0, 6.0, np.inf])
  assert float(value) == np.inf
  ours = jl.DynamicLossScale(F32(2**10))
  loss, scaled = jl.scaled_value_and_grad(
    lambda w, x: f(*FP16_POLICY.cast_to_compute((w, x))), ours
  )(w, x)
  true, finite, following = ours.unscale_and_adjust(scaled, w)
  assert not bool(finite) and float(following.loss_scale) == 2**9
  np.testing.assert_array_equal(true, [1.0, 2.0, 3.0, np.inf])
  assert float(loss) == 70.0


def test_mpx_casts_the_loss_scale_to_fp16(mpx):
  """(b) MPX multiplies by ``loss_scaling.astype(float16)``."""
  two = jnp.float16(2.0)
  for scale in (2.0**15, 65504.0):  # 65504: the largest scale MPX's adjust lets it reach
    assert float(mpx.DynamicLossScaling(F32(scale), F32(1)).scale(two)) == np.inf
    ours = jl.DynamicLossScale(F32(scale)).scale(two)
    assert ours.dtype == F32 and float(ours) == 2.0 * scale
  # MPX returns that inf as the loss, although the gradients (2^15 each) are finite.
  w = jnp.ones(2)
  value, _, finite, grads = mpx.filter_value_and_grad(
    jnp.sum, mpx.DynamicLossScaling(F32(2**15), F32(1))
  )(w)
  assert float(value) == np.inf and bool(finite)
  np.testing.assert_array_equal(grads, [1.0, 1.0])
  ours = jl.DynamicLossScale(F32(2**15))
  loss, scaled = jl.scaled_value_and_grad(lambda w: jnp.sum(w.astype(F16)), ours)(w)
  assert loss.dtype == F16 and float(loss) == 2.0
  np.testing.assert_array_equal(ours.unscale(scaled), [1.0, 1.0])
  # A scale above 65504 is inf in fp16, even for an fp32 loss: every step overflows. jmp_lite
  # keeps it in fp32, and the fp16 cotangents it reaches (2^16 / 4 (p - onehot)) are finite.
  scale = 2.0**16
  assert float(mpx.DynamicLossScaling(F32(scale), F32(1)).scale(F32(1.0))) == np.inf
  _, (_, mpx_scale, mpx_finite, _) = mpx_value_and_grad(
    MODEL, mpx.DynamicLossScaling(F32(scale), F32(1)), X, Y
  )
  assert not bool(mpx_finite) and float(mpx_scale.loss_scaling) == 2**15
  _, _, (grads, finite, next_scale) = jl_value_and_grad(
    MODEL, jl.DynamicLossScale(F32(scale)), X, Y
  )
  assert bool(finite) and float(next_scale.loss_scale) == scale
  want = fp32_reference()[1]
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    assert rel_err(g, w) < 2**-7


def test_mpx_ignores_the_string_bfloat16(mpx):
  """(c) set_half_precision_datatype converts a string, then never stores it."""
  seen = []

  def f(x):
    seen.append(x.dtype)
    return jnp.sum(x * x)

  mpx.set_half_precision_datatype("bfloat16")
  assert mpx.half_precision_datatype() is F16
  mpx.filter_value_and_grad(f, mpx.DynamicLossScaling(F32(1), F32(1)))(jnp.ones(2))
  assert seen == [F16]  # the function ran in fp16
  mpx.set_half_precision_datatype(BF16)  # the dtype itself is stored...
  mpx.set_half_precision_datatype("float16")  # ...and the string ignored again
  assert mpx.half_precision_datatype() is BF16
  # jmp_lite parses the name, and names the part of a policy string it cannot.
  policy = jl.get_policy("params=float32,compute=bfloat16,output=float32")
  assert policy.compute_dtype is BF16 and jl.parse_dtype("bfloat16") == BF16
  closed = jax.make_jaxpr(jl.autocast(lambda w, x: x @ w, policy))(jnp.ones((2, 2)), jnp.ones(2))
  assert [e.invars[0].aval.dtype for e in closed.eqns if e.primitive.name == "dot_general"] == [
    BF16
  ]
  with pytest.raises(ValueError, match="bfloat61"):
    jl.get_policy("params=float32,compute=bfloat61,output=float32")
