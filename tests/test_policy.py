import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jmp_lite as jl

F32, F16, BF16 = np.dtype("float32"), np.dtype("float16"), np.dtype(jnp.bfloat16)
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
HALF = jl.half_dtype()


@pytest.mark.parametrize(
  "text, expected",
  [
    # jmp's grammar and defaults: params f32, compute follows params, output follows compute.
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("c=f16", (F32, F16, F16)),
    ("p=f16", (F16, F16, F16)),
    ("p=f16,c=bf16", (F16, BF16, BF16)),
    ("o=bf16", (F32, F32, BF16)),
    ("c=half,o=full", (F32, HALF, F32)),
    ("half", (HALF, HALF, HALF)),
    ("full", (F32, F32, F32)),
    ("bf16", (BF16, BF16, BF16)),
    ("f64", (np.dtype("float64"),) * 3),
    # Tolerant whitespace, case, any key order.
    ("  p = f32 ,\tc = bf16 , o = f32 ", (F32, BF16, F32)),
    ("O=F32,C=BF16", (F32, BF16, F32)),
    # Keras names: fp32 variables, 16-bit compute and layer outputs.
    ("mixed_bfloat16", (F32, BF16, BF16)),
    ("mixed_float16", (F32, F16, F16)),
    # fp8 compute leaves outputs in the param dtype.
    ("c=float8_e4m3fn", (F32, np.dtype(jnp.float8_e4m3fn), F32)),
    ("p=bf16,c=e5m2,o=f32", (BF16, np.dtype(jnp.float8_e5m2), F32)),
  ],
)
def test_get_policy(text, expected):
  policy = jl.get_policy(text)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
  assert jl.get_policy(str(policy)) == policy


# Bad spellings, and what get_policy (and get_fp8_policy, which reads the same grammar) raise.
GRAMMAR_ERRORS = [
  ("", ValueError, "Empty"),
  ("   ", ValueError, "Empty"),
  ("x=f32", ValueError, "Unknown key 'x'"),
  ("param=f32", ValueError, "Unknown key 'param'"),
  ("p=f32,p=f16", ValueError, "'params' given twice"),
  ("params=f32,p=bf16", ValueError, "'params' given twice"),
  ("p=", ValueError, "Malformed part 'p='"),
  ("=f32", ValueError, "Malformed"),
  ("p=f32,,c=bf16", ValueError, "Malformed"),
  ("p=f32,c", ValueError, "Malformed part 'c'"),
  ("p=f32,", ValueError, "Malformed"),
  ("c=float", ValueError, "Unknown dtype name 'float'"),
  ("bogus", ValueError, "Unknown dtype name 'bogus'"),
  ("c=int8", TypeError, "'int8' is not a floating-point dtype"),
  ("p=bool", TypeError, "not a floating-point"),
  ("e4m3", ValueError, "fp8 is accepted for the compute dtype only"),
  ("p=f8e4m3,c=f16", ValueError, "param_dtype=float8_e4m3fn"),
  ("c=f8e5m2,o=f8e5m2", ValueError, "output_dtype=float8_e5m2"),
  ("half,full", ValueError, "Malformed part 'half'"),
  ("fp8,half", ValueError, "Malformed part 'fp8'"),  # a bare fp8 is no fp8= part
]


@pytest.mark.parametrize("text, error, match", GRAMMAR_ERRORS)
def test_get_policy_errors(text, error, match):
  with pytest.raises(error, match=match):
    jl.get_policy(text)


@pytest.mark.parametrize("bad", [None, 3, jnp.float32, b"p=f32"])
def test_get_policy_rejects_non_strings(bad):
  with pytest.raises(TypeError, match="expects a string"):
    jl.get_policy(bad)


def test_get_policy_passes_a_policy_through():
  policy = jl.Policy(F32, BF16, F32)
  assert jl.get_policy(policy) is policy


def test_policy_accepts_dtype_objects_and_names():
  a = jl.Policy(jnp.float32, np.dtype("float16"), "bfloat16")
  b = jl.Policy(np.float32, jnp.float16, jnp.bfloat16)
  assert a == b and hash(a) == hash(b)
  assert a.param_dtype == jnp.float32 and a.compute_dtype == np.float16
  assert str(a) == "p=f32,c=f16,o=bf16"
  # Stored as jmp stores what get_policy parses: the JAX scalar types.
  assert (a.param_dtype, a.compute_dtype, a.output_dtype) == (jnp.float32, jnp.float16, BF16)
  assert a.param_dtype is jnp.float32 and a.compute_dtype is jnp.float16
  assert a.output_dtype is jnp.bfloat16


@pytest.mark.parametrize(
  "text, expected",
  [
    ("p=f32,c=f16,o=bf16", (jnp.float32, jnp.float16, jnp.bfloat16)),
    ("mixed_bfloat16", (jnp.float32, jnp.bfloat16, jnp.bfloat16)),
    ("half", (HALF,) * 3),
    ("full", (jnp.float32,) * 3),
    ("c=float8_e4m3fn", (jnp.float32, jnp.float8_e4m3fn, jnp.float32)),
    ("p=bf16,c=e5m2", (jnp.bfloat16, jnp.float8_e5m2, jnp.bfloat16)),
  ],
)
def test_policy_dtypes_are_jax_scalar_types(text, expected):
  policy = jl.get_policy(text)
  got = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  assert all(x is y for x, y in zip(got, expected, strict=True)), got
  x = policy.compute_dtype(1.5)  # callable, as jmp's dtypes are
  assert x.dtype == np.dtype(expected[1]) and float(x) == 1.5
  table = {jnp.float32: 32, jnp.float16: 16, jnp.bfloat16: 16, jnp.float64: 64}
  table.update({jnp.float8_e4m3fn: 8, jnp.float8_e5m2: 8})
  assert table[policy.compute_dtype] == jnp.dtype(policy.compute_dtype).itemsize * 8
  assert policy.compute_dtype == np.dtype(expected[1]) == policy.compute_dtype
  assert policy.with_output_dtype("f16").output_dtype is jnp.float16


def test_modules_that_name_policy_dtypes_accept_scalar_types():
  # Error and warning messages elsewhere print a policy's dtypes by name.
  with pytest.raises(ValueError, match="compute dtype float8_e4m3fn"):
    jl.fp8.Fp8Policy(jl.get_policy("c=e4m3"))

  import flax.linen as nn

  from jmp_lite import flax as jl_flax

  model = nn.Dense(2, dtype=jnp.float32)  # an explicit dtype= the policy warns about
  x = jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  with pytest.warns(jl_flax.ExplicitDtypeWarning, match="dtype=float32, policy: bfloat16"):
    out = jl_flax.policy_apply(model, jl.get_policy("p=f32,c=bf16,o=f32"))(variables, x)
  assert out.dtype == F32


def test_policy_rejects_bad_dtypes():
  with pytest.raises(TypeError, match="int32"):
    jl.Policy(jnp.int32, F32, F32)
  with pytest.raises(TypeError, match="got None"):
    jl.Policy(F32, None, F32)
  with pytest.raises(ValueError, match="Unknown dtype name"):
    jl.Policy("f33", F32, F32)


def test_with_output_dtype():
  policy = jl.get_policy("p=f32,c=bf16,o=bf16").with_output_dtype(jnp.float32)
  assert policy == jl.Policy(F32, BF16, F32)
  with pytest.raises(ValueError):
    policy.with_output_dtype("float8_e4m3fn")


def test_casts_only_floating_array_leaves():
  policy = jl.get_policy("p=f32,c=bf16,o=f16")
  tree = {
    "w": jnp.ones((2, 3), jnp.float32),
    "np": np.ones(3, np.float64),
    "i": jnp.arange(3),
    "u8": np.arange(3, dtype=np.uint8),
    "b": jnp.array([True]),
    "py": 1.5,
    "none": None,
    "s": "text",
  }
  for cast, dtype in [
    (policy.cast_to_compute, BF16),
    (policy.cast_to_output, F16),
    (policy.cast_to_param, F32),
  ]:
    out = cast(tree)
    assert out["w"].dtype == dtype and out["np"].dtype == dtype
    assert isinstance(out["np"], np.ndarray)  # numpy stays numpy
    assert out["i"] is tree["i"] and out["u8"] is tree["u8"] and out["b"] is tree["b"]
    assert out["py"] == 1.5 and isinstance(out["py"], float)
    assert out["none"] is None and out["s"] == "text"


def test_cast_is_a_no_op_when_dtype_matches():
  x = jnp.ones(3, jnp.float32)
  assert jl.cast_to_full(x) is x


def test_casts_under_jit_vmap_and_grad():
  policy = jl.get_policy("p=f32,c=f16,o=f32")

  def f(w, x):
    y = policy.cast_to_compute(w) * policy.cast_to_compute(x)
    assert y.dtype == F16
    return policy.cast_to_output(y).sum()

  w = jnp.arange(4.0)
  g = jax.jit(jax.grad(f))(w, jnp.ones(4))
  assert g.dtype == F32  # cotangents come back in the param dtype
  np.testing.assert_array_equal(g, np.ones(4))
  out = jax.vmap(lambda x: policy.cast_to_compute(x))(jnp.ones((3, 2)))
  assert out.dtype == F16


def test_cast_to_full_and_half():
  tree = (jnp.ones(2, jnp.bfloat16), np.ones(2, np.float16), jnp.arange(2))
  full = jl.cast_to_full(tree)
  assert [x.dtype for x in full] == [F32, F32, np.dtype("int32")]
  half = jl.cast_to_half(full)
  assert [x.dtype for x in half] == [HALF, HALF, np.dtype("int32")]


def test_policy_is_hashable_static_argument_and_picklable():
  policy = jl.get_policy("p=f32,c=bf16,o=f32")
  f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
  assert f(jnp.ones(2), policy).dtype == BF16
  assert pickle.loads(pickle.dumps(policy)) == policy


finite_f32 = hnp.arrays(
  np.float32,
  hnp.array_shapes(max_dims=2, max_side=8),
  elements=st.floats(width=32, allow_nan=False),
)


@given(finite_f32)
def test_cast_matches_ml_dtypes_rounding(x):
  policy = jl.get_policy("p=f32,c=bf16,o=f32")
  down = policy.cast_to_compute(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(down), x.astype(ml_dtypes.bfloat16))
  # Widening back is exact: every bf16 value is an f32 value.
  np.testing.assert_array_equal(
    np.asarray(policy.cast_to_param(down)), x.astype(ml_dtypes.bfloat16).astype(np.float32)
  )


@given(
  hnp.arrays(
    np.float16,
    hnp.array_shapes(max_dims=2, max_side=8),
    elements=st.floats(width=16, allow_nan=False, allow_infinity=False),
  )
)
def test_half_to_full_to_half_round_trip_is_exact(x):
  policy = jl.get_policy("p=f32,c=f16")
  back = policy.cast_to_compute(jl.cast_to_full(jnp.asarray(x)))
  np.testing.assert_array_equal(np.asarray(back).view(np.uint16), x.view(np.uint16))


@given(
  st.sampled_from(["f32", "f16", "bf16", "half", "full", "f64"]),
  st.sampled_from(["f32", "f16", "bf16", "half", "e4m3", "e5m2", None]),
  st.sampled_from(["f32", "f16", "bf16", None]),
  st.permutations(["p", "c", "o"]),
  st.booleans(),
)
def test_str_round_trips(p, c, o, order, long_keys):
  names = {"p": "params", "c": "compute", "o": "output"}
  values = {"p": p, "c": c, "o": o}
  parts = [f"{names[k] if long_keys else k} = {values[k]}" for k in order if values[k]]
  policy = jl.get_policy(" , ".join(parts))
  assert jl.get_policy(str(policy)) == policy


# fp8 policies: the same grammar with an fp8= key ---------------------------------------


@pytest.mark.parametrize(
  "spec, policy, recipe",
  [
    ("p=f32,c=bf16,o=f32,fp8=hybrid", "p=f32,c=bf16,o=f32", (E4M3, E5M2)),
    (" fp8 = E4M3 , params=float32, compute=bfloat16", "p=f32,c=bf16,o=bf16", (E4M3, E4M3)),
    ("mixed_bfloat16,fp8=e5m2", "mixed_bfloat16", (E5M2, E5M2)),
    ("fp8=hybrid", "full", (E4M3, E5M2)),
    ("p=f32,c=bf16,fp8=f8e5m2/float8_e4m3fn", "p=f32,c=bf16", (E5M2, E4M3)),
    ("p=f32,c=f8e4m3", "full", (E4M3, E5M2)),  # the fp8 compute dtype spelling
    ("p=bf16,c=e5m2,o=f32", "p=bf16,c=bf16,o=f32", (E5M2, E5M2)),
    ("p=f32,c=bf16,o=f32,fp8=none", "p=f32,c=bf16,o=f32", None),
    ("half", "half", None),
  ],
)
def test_get_fp8_policy(spec, policy, recipe):
  got = jl.fp8.get_fp8_policy(spec)
  assert got.policy == jl.get_policy(policy)
  if recipe is None:
    assert got.config is None
  else:
    assert (got.config.fwd_dtype, got.config.bwd_dtype) == recipe
  assert jl.fp8.get_fp8_policy(str(got)) == got
  assert jl.fp8.get_fp8_policy(got) is got
  assert jl.fp8.get_fp8_policy(jl.get_policy(policy)).config is None


def test_get_fp8_policy_config_options():
  got = jl.fp8.get_fp8_policy("p=f32,c=bf16,fp8=delayed", amax_history_length=16, margin=1)
  assert got.config == jl.fp8.DelayedScaling(amax_history_length=16, margin=1)
  assert str(got) == "p=f32,c=bf16,o=bf16,fp8=delayed"
  assert jl.fp8.get_fp8_policy(got, margin=2).config == jl.fp8.DelayedScaling(
    amax_history_length=16, margin=2
  )
  current = jl.fp8.get_fp8_policy("fp8=hybrid", power_of_2=True).config
  assert current == jl.fp8.CurrentScaling(power_of_2=True)


@pytest.mark.parametrize(
  "spec, kwargs, error, match",
  [
    ("p=f32,fp8=fast", {}, ValueError, "Unknown fp8 recipe 'fast'"),
    ("fp8=hybrid,fp8=e4m3", {}, ValueError, "'fp8' given twice"),
    ("c=f8e4m3,fp8=hybrid", {}, ValueError, "both an fp8 compute dtype and an fp8= recipe"),
    ("fp8=bf16/e5m2", {}, ValueError, "forward format must be an fp8 format"),
    ("p=f32,c=bf16", {"margin": 1}, ValueError, r"fp8 options \['margin'\]"),
    ("fp8=delayed", {"amax_history_length": 0}, ValueError, "got 0"),
    ("p=f32,x=bf16,fp8=hybrid", {}, ValueError, "Unknown key 'x'"),
    (3, {}, TypeError, "get_fp8_policy expects a string"),
  ],
)
def test_get_fp8_policy_errors(spec, kwargs, error, match):
  with pytest.raises(error, match=match):
    jl.fp8.get_fp8_policy(spec, **kwargs)


def test_fp8_policy_rejects_fp8_compute_policy():
  with pytest.raises(ValueError, match="compute dtype float8_e4m3fn"):
    jl.fp8.Fp8Policy(jl.get_policy("p=f32,c=f8e4m3"), jl.fp8.Fp8Config())
  with pytest.raises(TypeError, match="jmp_lite Policy"):
    jl.fp8.Fp8Policy("p=f32", None)


@pytest.mark.parametrize("text, error, match", GRAMMAR_ERRORS)
def test_get_fp8_policy_reads_the_same_grammar(text, error, match):
  """One parser: what get_policy rejects, get_fp8_policy rejects with the same error."""
  with pytest.raises(error, match=match):
    jl.fp8.get_fp8_policy(text)
  with pytest.raises(error, match=match):
    jl.fp8.get_fp8_policy(text + ",fp8=hybrid" if text.strip() else "")


@pytest.mark.parametrize(
  "text, match, policy, fwd_dtype",
  [
    (
      "p=f32,fp8=hybrid",
      r"Unknown key 'fp8' .*\(fp8= is read by get_fp8_policy\)",
      "p=f32",
      "float8_e4m3fn",
    ),
    ("mixed_bfloat16,fp8=e5m2", "Unknown key 'fp8'", "mixed_bfloat16", "float8_e5m2"),
    ("fp8=hybrid", "Unknown key 'fp8'", "p=f32,c=f32,o=f32", "float8_e4m3fn"),
  ],
)
def test_get_policy_points_fp8_keys_to_get_fp8_policy(text, match, policy, fwd_dtype):
  with pytest.raises(ValueError, match=match):
    jl.get_policy(text)
  # get_fp8_policy reads it: the policy of the other parts (float32 if none), the default
  # recipe with the formats (E5M2 gradients in both) and the defaults for the rest.
  expected = jl.fp8.CurrentScaling(np.dtype(fwd_dtype), np.dtype("float8_e5m2"))
  assert jl.fp8.get_fp8_policy(text) == jl.fp8.Fp8Policy(
    policy=jl.get_policy(policy), config=expected
  )


@pytest.mark.parametrize(
  "spec, match",
  [
    ("fp8=", "Malformed part 'fp8='"),
    ("p=f32,,fp8=hybrid", "Malformed part ''"),
    ("p=f32,fp8=hybrid,", "Malformed part ''"),
    ("half,p=f32,fp8=hybrid", "Malformed part 'half'"),
    (" FP8 = Hybrid , fp8=none", "'fp8' given twice"),
    ("p=f32,x=bf16,fp8=hybrid", r"expected params/p, compute/c, output/o or fp8\."),
  ],
)
def test_get_fp8_policy_errors_name_the_part(spec, match):
  with pytest.raises(ValueError, match=match) as info:
    jl.fp8.get_fp8_policy(spec)
  assert f"in policy {spec!r}" in str(info.value)


# fp8 policies name every recipe ---------------------------------------------------------

RECIPES_BY_NAME = {
  "current": jl.fp8.CurrentScaling(),
  "delayed": jl.fp8.DelayedScaling(),
  "rowwise": jl.fp8.RowwiseScaling(),
  "block": jl.fp8.BlockScaling(),
  "mxfp8": jl.fp8.Mxfp8Scaling(),
}


@pytest.mark.parametrize(
  "value, recipe, spelled",
  [
    *((name, recipe, name) for name, recipe in RECIPES_BY_NAME.items()),
    ("hybrid", jl.fp8.CurrentScaling(), "current"),  # formats alone: the default recipe
    ("e4m3", jl.fp8.CurrentScaling(bwd_dtype=E4M3), "current:e4m3"),
    ("delayed:e4m3", jl.fp8.DelayedScaling(bwd_dtype=E4M3), "delayed:e4m3"),
    ("rowwise:hybrid", jl.fp8.RowwiseScaling(bwd_dtype=E5M2), "rowwise:hybrid"),
    (" Block : E5M2 ", jl.fp8.BlockScaling(E5M2), "block:e5m2"),
    ("mxfp8:f8e5m2/f8e4m3", jl.fp8.Mxfp8Scaling(E5M2, E4M3), "mxfp8:f8e5m2/f8e4m3"),
  ],
)
def test_fp8_policy_names_every_recipe_and_spells_it_back(value, recipe, spelled):
  got = jl.fp8.get_fp8_policy(f"p=f32,c=bf16,o=f32,fp8={value}")
  assert got == jl.fp8.Fp8Policy(jl.get_policy("p=f32,c=bf16,o=f32"), recipe)
  assert type(got.config) is type(recipe)
  assert str(got) == f"p=f32,c=bf16,o=f32,fp8={spelled}"
  assert jl.fp8.get_fp8_policy(str(got)) == got


def test_fp8_policy_default_is_current_scaling():
  base = jl.get_policy("p=f32,c=bf16,o=f32")
  assert jl.fp8.Fp8Policy(base).config == jl.fp8.CurrentScaling()
  assert jl.fp8.get_fp8_policy("fp8=hybrid").config == jl.fp8.CurrentScaling()
  assert jl.fp8.get_fp8_policy("p=f32,c=f8e4m3").config == jl.fp8.CurrentScaling()
  # An Fp8Config is delayed scaling with its fields, and is stored as the recipe.
  config = jl.fp8.Fp8Policy(base, jl.fp8.Fp8Config(amax_history_length=8)).config
  assert config == jl.fp8.DelayedScaling(amax_history_length=8)
  assert type(config) is jl.fp8.DelayedScaling


@pytest.mark.parametrize(
  "spec, kwargs, error, match",
  [
    (
      "fp8=rowwize",
      {},
      ValueError,
      r"Unknown fp8 recipe 'rowwize' .*expected a recipe \(current, delayed, rowwise, block, "
      r"mxfp8\), formats \(hybrid, e4m3, e5m2",
    ),
    ("fp8=fast:e4m3", {}, ValueError, r"Unknown fp8 recipe 'fast' in 'fast:e4m3'.*mxfp8"),
    ("fp8=delayed:fast", {}, ValueError, r"Unknown fp8 recipe 'fast' .*delayed:hybrid"),
    ("fp8=delayed:", {}, ValueError, r"Missing formats after 'delayed'"),
    ("fp8=block:hybrid", {}, ValueError, "block scaling uses one format for every tensor"),
    (
      "fp8=current",
      {"amax_history_length": 4},
      ValueError,
      r"fp8 options \['amax_history_length'\] given for CurrentScaling.*its options are "
      r"\['fwd_dtype', 'bwd_dtype', 'power_of_2', 'margin', 'fast_accumulation'\]",
    ),
    ("fp8=delayed:e4m3", {"bwd_dtype": E5M2}, ValueError, r"\['bwd_dtype'\] given as keywords"),
    ("fp8=none", {"margin": 1}, ValueError, "given for a policy without fp8"),
  ],
)
def test_fp8_policy_recipe_errors_name_the_value_and_the_accepted(spec, kwargs, error, match):
  with pytest.raises(error, match=match):
    jl.fp8.get_fp8_policy(spec, **kwargs)


def test_fp8_policy_refuses_what_is_not_a_recipe():
  base = jl.get_policy("p=f32,c=bf16,o=f32")
  with pytest.raises(TypeError, match=r"config must be an fp8 recipe .* got 'current' of type str"):
    jl.fp8.Fp8Policy(base, "current")

  class Unhashable:
    __hash__ = None

    def init_state(self):
      return None

    def dot_general(self, call, state, amax):
      return call.lhs

  with pytest.raises(TypeError, match="is not hashable; a recipe is static under jit"):
    jl.fp8.Fp8Policy(base, Unhashable())
  policy = jl.fp8.get_fp8_policy("fp8=rowwise")
  with pytest.raises(ValueError, match=r"\['margin'\] given for RowwiseScaling"):
    jl.fp8.get_fp8_policy(policy, margin=1)
