"""A jmp 0.0.4 user's code runs unchanged with `import jmp_lite as jmp`."""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jmp

JMP_ALL = (
  "all_finite",
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "select_tree",
  "StaticLossScale",
  "cast_to_full",
  "cast_to_half",
  "get_policy",
  "half_dtype",
  "Policy",
)


def test_every_jmp_name_exists():
  for name in JMP_ALL:
    assert name in jmp.__all__ and hasattr(jmp, name)


def _public_parameters(cls):
  # `_checked` (keyword-only, static pytree data) is set by the constructor, never passed.
  return [p for p in inspect.signature(cls).parameters if not p.startswith("_")]


def test_constructor_argument_order_matches_jmp():
  params = _public_parameters(jmp.DynamicLossScale)
  assert params[:5] == ["loss_scale", "counter", "period", "factor", "min_loss_scale"]
  assert _public_parameters(jmp.StaticLossScale) == ["loss_scale"]
  assert list(inspect.signature(jmp.Policy).parameters) == [
    "param_dtype",
    "compute_dtype",
    "output_dtype",
  ]


def test_jmp_readme_training_loop():
  # The loop from jmp's README and DynamicLossScale docstring, positional arguments included.
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  assert policy == jmp.Policy(
    param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32
  )
  loss_scale = jmp.DynamicLossScale(
    jnp.asarray(2.0**10), np.zeros([], np.int32), 2, 2, np.ones([], np.float32)
  )
  params = {"w": jnp.full((3,), 0.5)}
  x = jnp.ones((4, 3))

  @jax.jit
  def step(params, loss_scale):
    def loss_fn(p):
      p, xc = policy.cast_to_compute((p, x))
      loss = policy.cast_to_output(jnp.sum(xc @ p["w"]))
      return loss_scale.scale(loss)

    grads = loss_scale.unscale(jax.grad(loss_fn)(params))
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    new = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    return jmp.select_tree(grads_finite, new, params), loss_scale, grads

  params, loss_scale, grads = step(params, loss_scale)
  np.testing.assert_array_equal(grads["w"], np.full(3, 4.0))  # exact: scale is 2^10
  assert grads["w"].dtype == jnp.float32
  params, loss_scale, _ = step(params, loss_scale)
  assert float(loss_scale.loss_scale) == 2.0**11 and int(loss_scale.counter) == 0
  np.testing.assert_allclose(params["w"], 0.5 - 2 * 0.01 * 4.0)


def test_policy_is_a_frozen_dataclass_like_jmp():
  policy = jmp.get_policy("c=bf16")
  assert dataclasses.is_dataclass(policy)
  assert str(policy) == "p=f32,c=bf16,o=bf16"  # jmp's key=value format
  assert policy.compute_dtype == jnp.bfloat16 and jnp.bfloat16 == policy.compute_dtype


def test_loss_scale_attribute_and_adjust_on_all_kinds():
  for scale, value in (
    (jmp.NoOpLossScale(), 1.0),
    (jmp.StaticLossScale(jnp.float32(4.0)), 4.0),
    (jmp.DynamicLossScale(jnp.float32(4.0)), 4.0),
  ):
    # jmp's LossScale is a Union; jmp_lite's a static Protocol, which isinstance refuses.
    with pytest.raises(TypeError, match="runtime_checkable"):
      isinstance(scale, jmp.LossScale)
    assert float(scale.loss_scale) == value
    # A finite step keeps the scale (a dynamic one grows only after `period` steps).
    adjusted = scale.adjust(jnp.array(True))
    assert type(adjusted) is type(scale) and float(adjusted.loss_scale) == value
  dynamic = jmp.DynamicLossScale(jnp.float32(4.0)).adjust(jnp.array(True))
  assert int(dynamic.counter) == 1


# --- jmp's README, run as written (`import jmp_lite as jmp`) -------------------------------------


def test_jmp_readme_policies():
  half = jnp.float16  # the README's setup; "On TPU this should be jnp.bfloat16."
  full = jnp.float32
  my_policy = jmp.Policy(compute_dtype=half, param_dtype=full, output_dtype=half)

  def layer(params, x):
    params, x = my_policy.cast_to_compute((params, x))
    w, b = params
    y = x @ w + b
    return my_policy.cast_to_output(y)

  # The README builds {"w": ...}, which `w, b = params` cannot unpack (in jmp too): a (w, b) pair.
  params = (jnp.ones([3, 2], dtype=my_policy.param_dtype), jnp.zeros([2], my_policy.param_dtype))
  assert params[0].dtype == jnp.float32
  y = layer(params, jnp.ones([4, 3]))
  assert y.dtype == half
  np.testing.assert_array_equal(y, np.full((4, 2), 3.0))

  my_policy = my_policy.with_output_dtype(full)
  assert my_policy.output_dtype is jnp.float32 and layer(params, jnp.ones([4, 3])).dtype == full

  my_policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  float16 = jmp.get_policy("float16")  # Everything in f16.
  half_policy = jmp.get_policy("half")  # Everything in half (f16 or bf16).
  assert (my_policy.param_dtype, my_policy.compute_dtype, my_policy.output_dtype) == (
    jnp.float32,
    jnp.float16,
    jnp.float32,
  )
  assert {float16.param_dtype, float16.compute_dtype, float16.output_dtype} == {jnp.float16}
  assert half_policy.compute_dtype is jmp.half_dtype()


def _readme_train_step(loss_scale, params, x):
  """The README's loss-scaling train_step, with SGD as apply_optimizer."""

  def my_loss_fn(params, loss_scale):
    loss = jnp.sum((x @ params["w"]) ** 2)
    return loss_scale.scale(loss)

  grads = jax.grad(my_loss_fn)(params, loss_scale)
  grads = loss_scale.unscale(grads)

  def apply_optimizer(params, grads):
    return jax.tree.map(lambda p, g: p - 0.125 * g, params, grads)

  skip_nonfinite_updates = isinstance(loss_scale, jmp.DynamicLossScale)
  if skip_nonfinite_updates:
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    params = jmp.select_tree(grads_finite, apply_optimizer(params, grads), params)
  else:
    params = apply_optimizer(params, grads)
  return params, loss_scale


def test_jmp_readme_loss_scaling():
  x = jnp.ones((1, 2))
  params = {"w": jnp.full((2,), 0.25)}
  # d/dw (x @ w)^2 = 2 (x @ w) x = [1, 1]; one SGD step of 0.125 gives 0.125, exactly.
  expected = np.full(2, 0.125, np.float32)

  step = jax.jit(_readme_train_step)
  new, loss_scale = step(jmp.StaticLossScale(2**15), params, x)
  np.testing.assert_array_equal(new["w"], expected)
  assert float(loss_scale.loss_scale) == 2.0**15

  loss_scale = jmp.DynamicLossScale(jmp.half_dtype()(2**15))  # the README's line
  assert loss_scale.loss_scale.dtype == jnp.dtype(jmp.half_dtype())
  new, loss_scale = step(loss_scale, params, x)
  np.testing.assert_array_equal(new["w"], expected)
  assert float(loss_scale.loss_scale) == 2.0**15 and int(loss_scale.counter) == 1

  # The DynamicLossScale docstring's construction.
  assert jmp.DynamicLossScale(jnp.asarray(2.0**15)).loss_scale.dtype == jnp.float32

  loss = jnp.float32(3.0)
  grads = {"w": jnp.ones(2)}
  grads_finite = jmp.all_finite(grads)
  loss_scale = jmp.NoOpLossScale()
  assert loss is loss_scale.scale(loss)
  assert grads is loss_scale.unscale(grads)
  assert loss_scale is loss_scale.adjust(grads_finite)
  assert loss_scale.loss_scale == 1


def test_policy_dtypes_are_jax_scalar_types_like_jmps():
  # jmp's README and user code call, hash and compare the dtypes jmp returns.
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  assert policy.compute_dtype is jnp.float16 and policy.param_dtype is jnp.float32
  x = policy.compute_dtype(1.0)
  assert x.dtype == np.float16 and float(x) == 1.0
  table = {jnp.float16: "f16", jnp.bfloat16: "bf16", jnp.float32: "f32"}
  assert table[policy.compute_dtype] == "f16" and table[policy.output_dtype] == "f32"
  assert {np.float16: "f16"}[policy.compute_dtype] == "f16"
  assert jnp.dtype(policy.compute_dtype) == np.dtype("float16")
  assert policy.compute_dtype == np.dtype("float16") and np.dtype("float16") == policy.compute_dtype
  assert jmp.half_dtype() is jnp.bfloat16  # CPU; jmp's would be jnp.float16 here
  np.testing.assert_array_equal(jmp.half_dtype()(2**15), np.float32(2**15))
  assert jmp.half_dtype()(2**15).dtype == jnp.bfloat16
  fp8 = jmp.get_policy("c=float8_e4m3fn")
  assert fp8.compute_dtype is jnp.float8_e4m3fn and fp8.output_dtype is jnp.float32
  assert jmp.get_policy("p=bf16,c=e5m2,o=f32").compute_dtype is jnp.float8_e5m2


def test_dynamic_loss_scale_warns_on_an_integer_scale_like_jmp():
  for scale in (2**15, jnp.asarray(2**15, dtype=jnp.int32), np.int64(2**15)):
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale, got int") as w:
      loss_scale = jmp.DynamicLossScale(scale)
    assert w[0].filename == __file__  # points at the caller, not at jmp_lite
    assert loss_scale.loss_scale.dtype == jnp.float32 and float(loss_scale.loss_scale) == 2.0**15
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # jmp's test_dynamic_loss_scale_no_warnings
    jmp.DynamicLossScale(2.0**15)
    jmp.DynamicLossScale(jnp.float16(2.0**15), period=10.0)
    jmp.StaticLossScale(2**15)  # jmp's StaticLossScale does not warn either


def test_dynamic_loss_scale_accepts_an_integral_float_period_like_jmp():
  loss_scale = jmp.DynamicLossScale(jnp.float32(4.0), period=2000.0)
  assert loss_scale.period == 2000 and isinstance(loss_scale.period, int)
  loss_scale = jmp.DynamicLossScale(jnp.float32(4.0), np.zeros([], np.int32), np.float64(2.0))
  loss_scale = loss_scale.adjust(jnp.array(True)).adjust(jnp.array(True))
  assert float(loss_scale.loss_scale) == 8.0 and int(loss_scale.counter) == 0
  assert loss_scale.counter.dtype == jnp.int32
  for bad in (2000.5, float("inf"), float("nan")):
    with pytest.raises(TypeError, match="period must be an int"):
      jmp.DynamicLossScale(jnp.float32(4.0), period=bad)
  with pytest.raises(ValueError, match="period must be >= 1"):
    jmp.DynamicLossScale(jnp.float32(4.0), period=0.0)


# --- Differential: the same calls against jmp 0.0.4 itself (skipped when jmp is not installed) ---


@pytest.fixture
def real_jmp():
  return pytest.importorskip("jmp", minversion="0.0.4")


@pytest.mark.parametrize(
  "text",
  [
    "params=float32,compute=float16,output=float32",
    "params=float32,compute=bfloat16,output=float32",
    "p=f32,c=bf16,o=f32",
    "c=f16",
    "p=f16,c=bf16",
    "o=bf16",
    "c=bfloat16,o=full",
    "float16",
    "bf16",
    "full",
    "f64",
  ],
)
def test_get_policy_returns_jmps_dtypes(real_jmp, text):
  ours, theirs = jmp.get_policy(text), real_jmp.get_policy(text)
  for field in ("param_dtype", "compute_dtype", "output_dtype"):
    assert getattr(ours, field) is getattr(theirs, field), field
  assert repr(ours) == repr(theirs)


def test_policy_fields_compare_like_jmps(real_jmp):
  given = (np.float32, np.float16, jnp.bfloat16)
  ours, theirs = jmp.Policy(*given), real_jmp.Policy(*given)
  assert theirs.compute_dtype is np.float16  # jmp stores what it is given ...
  assert ours.compute_dtype is jnp.float16  # ... jmp_lite the JAX scalar type, which equals it
  for a, b in zip(dataclasses.astuple(ours), dataclasses.astuple(theirs), strict=True):
    assert a == b and b == a and hash(a) == hash(b)
  assert type(jmp.half_dtype()) is type(real_jmp.half_dtype())  # both jnp scalar types
  tree = {"np": np.ones(2, np.float64), "jnp": jnp.ones(2), "i": jnp.arange(2), "s": 1.5}
  for cast in ("cast_to_param", "cast_to_compute", "cast_to_output"):
    a, b = getattr(ours, cast)(tree), getattr(theirs, cast)(tree)
    kinds = lambda tree: jax.tree.map(lambda x: (type(x), getattr(x, "dtype", None)), tree)
    assert kinds(a) == kinds(b)


def _follow_jmp(ours, theirs, flags):
  """Adjusts both scales by ``flags``, asserting after each step that they agree exactly."""
  for finite in flags:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # jmp's adjust rebuilds its object and warns again
      theirs = theirs.adjust(jnp.array(finite))
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # jmp_lite warns once, at construction
      ours = ours.adjust(jnp.array(finite))
    assert float(ours.loss_scale) == float(theirs.loss_scale)
    assert int(ours.counter) == int(theirs.counter)
    assert ours.loss_scale.dtype == theirs.loss_scale.dtype
  return ours


def test_dynamic_loss_scale_follows_jmps_trajectory(real_jmp):
  flags = [True, True, True, False, True, False, False, False, True, True, True, True, True]
  args = (jnp.float32(8.0), np.zeros([], np.int32), 3, 2, np.float32(2.0))
  ours, theirs = jmp.DynamicLossScale(*args), real_jmp.DynamicLossScale(*args)
  ours = _follow_jmp(ours, theirs, flags)
  # It went through growth (8 -> 16), back-off to the floor (2) and growth again (4).
  assert (float(ours.loss_scale), int(ours.counter)) == (4.0, 2)


def test_integer_scale_warning_matches_jmps(real_jmp):
  for lib in (jmp, real_jmp):
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale, got int32"):
      lib.DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      lib.DynamicLossScale(2.0**15, period=2000.0)


def test_loss_scales_and_helpers_agree_with_jmp(real_jmp):
  grads = {"a": jnp.array([2.0**12, 3.0]), "b": jnp.float32(0.5)}
  for make in (lambda m: m.StaticLossScale(jnp.float32(2.0**10)), lambda m: m.NoOpLossScale()):
    ours, theirs = make(jmp), make(real_jmp)
    for method in ("scale", "unscale"):
      a, b = getattr(ours, method)(grads), getattr(theirs, method)(grads)
      jax.tree.map(np.testing.assert_array_equal, a, b)
      assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)
  trees = [None, {}, grads, {"a": jnp.array([1.0, jnp.inf])}, {"n": jnp.array(jnp.nan)}]
  for tree in trees:
    assert bool(jmp.all_finite(tree)) == bool(real_jmp.all_finite(tree))
  a, b = {"a": jnp.ones(2), "b": jnp.zeros([])}, {"a": jnp.zeros(2), "b": jnp.ones([])}
  for pred in (True, False):
    ours = jmp.select_tree(jnp.bool_(pred), a, b)
    jax.tree.map(np.testing.assert_array_equal, ours, real_jmp.select_tree(jnp.bool_(pred), a, b))
  # The documented difference: jmp asserts, jmp_lite raises an error naming the problem.
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    real_jmp.select_tree(jnp.ones([1], bool), None, None)
  with pytest.raises(ValueError, match="pred must be a boolean scalar, got shape"):
    jmp.select_tree(jnp.ones([1], bool), None, None)


# Every constructor argument of DynamicLossScale in the forms jmp users pass it, jmp's own test
# suite's included (a zero floor as `jnp.asarray(0.)`, an integral float period, int factors).
DYNAMIC_ARGUMENTS = [
  ((jnp.float32(8.0),), {}),
  ((jnp.asarray(8, jnp.int32),), {}),  # an integer scale: both warn (jmp's adjust then fails)
  ((np.float32(8.0), jnp.int32(2), 3), {}),  # counter and period, positionally
  ((jnp.float32(8.0),), {"period": 3.0, "factor": 3}),  # an integral float period, int factor
  ((jnp.float32(8.0),), {"period": 2, "factor": 2.5}),
  ((jnp.asarray(10.0), jnp.int32(0), 5.0, 2.0, jnp.asarray(0.0)), {}),  # jmp's zero floor
  ((jnp.asarray(10.0), jnp.int32(0), 20, 2, jnp.asarray(0.3125)), {}),
  ((jnp.float32(8.0),), {"period": 2, "min_loss_scale": jnp.asarray(2, jnp.int32)}),  # warns
  ((jnp.float32(8.0),), {"period": 2, "min_loss_scale": np.int64(2)}),  # warns
  ((jnp.float32(8.0),), {"period": 2, "min_loss_scale": 2.0}),
]


def _built_with_warnings(make):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    built = make()
  return built, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("args, kwargs", DYNAMIC_ARGUMENTS)
def test_dynamic_loss_scale_constructor_arguments_behave_like_jmps(real_jmp, args, kwargs):
  ours, our_warnings = _built_with_warnings(lambda: jmp.DynamicLossScale(*args, **kwargs))
  theirs, their_warnings = _built_with_warnings(lambda: real_jmp.DynamicLossScale(*args, **kwargs))
  # Each of jmp's warnings is given, in jmp's words (jmp_lite adds what it converted to).
  assert len(our_warnings) >= len(their_warnings)
  for theirs_message, ours_message in zip(their_warnings, our_warnings, strict=False):
    assert ours_message.startswith(theirs_message)
  # The one warning jmp does not give: a zero floor lets the scale collapse to 0.
  extra = our_warnings[len(their_warnings) :]
  zero_floor = float(np.asarray(theirs.min_loss_scale)) == 0
  assert [m.split(":")[0] for m in extra] == (["min_loss_scale=0"] if zero_floor else [])
  for field in ("period", "factor", "min_loss_scale"):
    assert float(getattr(ours, field)) == float(np.asarray(getattr(theirs, field))), field
  if not jnp.issubdtype(jnp.asarray(theirs.loss_scale).dtype, jnp.floating):
    return  # jmp's adjust fails on an integer scale (lax.select of int32 and float32)
  # Growth, back-off down to the floor (or, with a zero floor, far below 1) and growth again.
  _follow_jmp(ours, theirs, [True] * 7 + [False] * 40 + [True] * 9)
