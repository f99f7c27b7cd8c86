import functools
import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax_testing import BF16, F16, F32, explicit_dtype_warnings
from jax import lax

import jmp_lite as jl
import jmp_lite.flax as jlf
from jmp_lite.flax._module_policy import as_module_policies, explicit_dtype

POLICY = "p=f32,c=bf16,o=f32"


class MyNorm(nn.LayerNorm):
  pass


def test_module_policy_parses_and_validates():
  mp = jlf.ModulePolicy(compute_dtype="f32", output_dtype=jnp.bfloat16, attributes={"x": 1})
  assert (mp.compute_dtype, mp.output_dtype) == (F32, BF16)
  assert mp == jlf.ModulePolicy(F32, "bf16", {"x": 1}) and hash(mp) == hash(
    jlf.ModulePolicy(F32, "bf16", {"x": 1})
  )
  assert mp != jlf.ModulePolicy(F32, "bf16", {"x": 2})
  with pytest.raises(TypeError):
    mp.attributes["y"] = 2  # read-only
  with pytest.raises(ValueError, match="Unknown dtype name 'f33'"):
    jlf.ModulePolicy(compute_dtype="f33")
  with pytest.raises(ValueError, match="fp8"):
    jlf.ModulePolicy(compute_dtype="e4m3")
  with pytest.raises(TypeError, match="not a floating-point"):
    jlf.ModulePolicy(output_dtype="int8")
  with pytest.raises(TypeError, match="mapping"):
    jlf.ModulePolicy(attributes=[("x", 1)])
  with pytest.raises(TypeError, match="identifiers"):
    jlf.ModulePolicy(attributes={"not valid": 1})
  with pytest.raises(TypeError, match="recompute must be a bool"):
    jlf.ModulePolicy(recompute="yes")


def test_defaults_keep_normalization_and_embeddings_in_fp32():
  policies = jlf.ModulePolicies(POLICY)
  for cls in (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, nnx.LayerNorm, nnx.BatchNorm,
              nnx.GroupNorm, nnx.RMSNorm, nn.Embed, nnx.Embed):  # fmt: skip
    resolved = policies.resolve(cls)
    assert resolved.compute_dtype == F32, cls
    # Islands hand their result back in the compute dtype.
    assert resolved.output_dtype == BF16 and resolved.root_output_dtype == F32
  assert policies.resolve(nn.LayerNorm).recompute and policies.resolve(nnx.RMSNorm).recompute
  # BatchNorm updates running statistics: it cannot be recomputed.
  assert not policies.resolve(nn.BatchNorm).recompute
  assert not policies.resolve(nnx.BatchNorm).recompute
  dense = policies.resolve(nn.Dense)
  assert (dense.compute_dtype, dense.output_dtype, dense.root_output_dtype) == (BF16, BF16, F32)


def test_overrides_merge_replace_and_remove_defaults():
  policies = jlf.ModulePolicies(
    POLICY,
    {nn.Dense: "f32", nn.LayerNorm: None, nn.Conv: jlf.ModulePolicy(output_dtype="f16")},
  )
  assert policies.resolve(nn.Dense).compute_dtype == F32
  assert policies.resolve(nn.LayerNorm).compute_dtype == BF16  # default removed
  assert policies.resolve(nn.BatchNorm).compute_dtype == F32  # other defaults kept
  conv = policies.resolve(nn.Conv)
  assert (conv.compute_dtype, conv.output_dtype, conv.root_output_dtype) == (BF16, F16, F16)
  assert policies.overrides[nn.LayerNorm] is None
  bare = jlf.ModulePolicies(POLICY, use_default_overrides=False)
  assert bare.resolve(nn.LayerNorm).compute_dtype == BF16
  assert dict(bare.overrides) == {}


def test_most_specific_class_wins():
  policies = jlf.ModulePolicies(POLICY)
  assert policies.resolve(MyNorm).compute_dtype == F32  # inherits LayerNorm's override
  policies = jlf.ModulePolicies(POLICY, {MyNorm: "f16"})
  assert policies.resolve(MyNorm).compute_dtype == F16
  assert policies.resolve(nn.LayerNorm).compute_dtype == F32
  # None: no override for the subclass, although its base has one.
  assert jlf.ModulePolicies(POLICY, {MyNorm: None}).resolve(MyNorm).compute_dtype == BF16


def test_modules_without_override_inherit_the_enclosing_one():
  policies = jlf.ModulePolicies(POLICY, {nn.Sequential: "f32"})
  block = policies.resolve(nn.Sequential)
  assert (block.compute_dtype, block.output_dtype) == (F32, BF16)
  dense = policies.resolve(nn.Dense, block)
  assert (dense.compute_dtype, dense.output_dtype, dense.hooks) == (F32, F32, ())
  norm = policies.resolve(nn.LayerNorm, block)  # an fp32 island inside an fp32 block
  assert (norm.compute_dtype, norm.output_dtype, norm.recompute) == (F32, F32, False)
  half = policies.resolve(nn.Dense, policies.resolve(nn.Dense))
  assert (half.compute_dtype, half.output_dtype) == (BF16, BF16)
  assert [(h.cls, h.attribute, h.replacement) for h in half.hooks] == [
    (nn.Dense, "dot_general", jlf.dot_general)
  ]


def test_recompute_only_for_islands():
  # Under an fp32 policy a LayerNorm is not an island: nothing to save by recomputing.
  assert not jlf.ModulePolicies("f32").resolve(nn.LayerNorm).recompute
  assert jlf.ModulePolicies(POLICY).resolve(nn.LayerNorm).recompute


@pytest.mark.parametrize(
  "overrides, error, match",
  [
    ({"Dense": "f32"}, TypeError, "module classes, got 'Dense'"),
    ({int: "f32"}, TypeError, "module classes"),
    ({nn.Dense: jl.get_policy("f32")}, TypeError, "is a Policy; use ModulePolicy"),
    ({nn.Dense: "float"}, ValueError, "override for Dense: Unknown dtype name"),
    ({nn.Dense: 3}, TypeError, "override for Dense"),
    ([(nn.Dense, "f32")], TypeError, "must be a mapping"),
  ],
)
def test_bad_overrides_are_rejected_at_construction(overrides, error, match):
  with pytest.raises(error, match=match):
    jlf.ModulePolicies(POLICY, overrides)


def test_fp8_compute_policy_is_rejected():
  with pytest.raises(ValueError, match="fp8"):
    jlf.ModulePolicies("p=f32,c=e4m3,o=f32")
  with pytest.raises(ValueError, match="Unknown dtype name"):
    jlf.ModulePolicies("p=f32,c=bogus")


def test_hooks_replace_only_flax_defaults_and_only_in_16_bits():
  policies = jlf.ModulePolicies(POLICY)
  assert policies.attribute_updates(nn.Dense(3)) == {"dot_general": jlf.dot_general}
  custom = lambda *a, **k: lax.dot_general(*a, **k)
  assert policies.attribute_updates(nn.Dense(3, dot_general=custom)) == {}
  assert policies.attribute_updates(nn.Dense(3, dot_general_cls=lambda: custom)) == {}
  assert policies.attribute_updates(nn.Conv(3, (3, 3))) == {
    "conv_general_dilated": jlf.conv_general_dilated
  }
  mha = nn.MultiHeadDotProductAttention(num_heads=2)
  assert policies.attribute_updates(mha) == {"attention_fn": jlf.dot_product_attention}
  linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  assert policies.attribute_updates(linear) == {"dot_general": jlf.dot_general}
  einsum = nnx.Einsum("ab,bc->ac", (2, 3), rngs=nnx.Rngs(0))
  assert policies.attribute_updates(einsum) == {"einsum_op": jlf.einsum}
  # Switched off, or not computing in 16 bits: Flax's kernels stay.
  off = jlf.ModulePolicies(POLICY, fp32_accumulation=False, fp32_softmax=False)
  assert off.attribute_updates(nn.Dense(3)) == {} and off.attribute_updates(mha) == {}
  assert jlf.ModulePolicies("f32").attribute_updates(nn.Dense(3)) == {}
  assert jlf.ModulePolicies(POLICY, {nn.Dense: "f32"}).attribute_updates(nn.Dense(3)) == {}


def test_user_attributes_beat_hooks_and_must_exist():
  policies = jlf.ModulePolicies(
    POLICY, {nn.Dense: jlf.ModulePolicy(attributes={"dot_general": lax.dot_general})}
  )
  assert policies.attribute_updates(nn.Dense(3)) == {"dot_general": lax.dot_general}
  policies = jlf.ModulePolicies(POLICY, {nn.Dense: jlf.ModulePolicy(attributes={"nope": 1})})
  with pytest.raises(AttributeError, match="'nope'"):
    policies.attribute_updates(nn.Dense(3))


def test_module_policies_are_values():
  a = jlf.ModulePolicies(POLICY, {nn.Dense: "f32"})
  assert a == jlf.ModulePolicies(jl.get_policy(POLICY), {nn.Dense: F32})
  assert hash(a) == hash(jlf.ModulePolicies(POLICY, {nn.Dense: "f32"}))
  assert a != jlf.ModulePolicies(POLICY)
  # The policy, then every class with an entry (the defaults first).
  text = repr(a)
  assert text.startswith("ModulePolicies(p=f32,c=bf16,o=f32, overrides=[flax.linen."), text
  assert text.endswith(", flax.linen.linear.Dense])") and text.count(", ") == 13, text
  # Options away from their defaults are shown too.
  bare = jlf.ModulePolicies(POLICY, use_default_overrides=False, fp32_softmax=False)
  assert repr(bare) == "ModulePolicies(p=f32,c=bf16,o=f32, overrides=[], fp32_softmax=False)"
  # Equal by what they do: the defaults given by hand are the defaults.
  assert jlf.ModulePolicies(POLICY, jlf.DEFAULT_OVERRIDES, use_default_overrides=False) == (
    jlf.ModulePolicies(POLICY)
  )
  with pytest.raises(AttributeError, match="ModulePolicies is immutable"):
    a.fp32_softmax = False
  assert a.fp32_softmax is True


# Every option but one away from its default.
OPTIONS = dict(
  overrides={nn.Dense: "f32"},
  use_default_overrides=False,
  fp32_accumulation=True,  # (the default: fp32_accumulation=False refuses grad_reduction_dtype)
  fp32_softmax=False,
  grad_reduction_dtype="float32",
  explicit_dtypes="keep",
)


def test_option_keywords_fold_into_one_module_policies():
  folded = as_module_policies(POLICY, OPTIONS, "policy_apply")
  assert folded == jlf.ModulePolicies(POLICY, **OPTIONS)
  assert dict(folded.overrides) == {nn.Dense: jlf.FP32}
  assert (folded.fp32_accumulation, folded.fp32_softmax) == (True, False)
  assert (folded.grad_reduction_dtype, folded.explicit_dtypes) == (F32, "keep")
  assert as_module_policies(jl.get_policy(POLICY), {}, "f") == jlf.ModulePolicies(POLICY)
  # A ModulePolicies is used as it is, alone or with keywords that agree with it
  # (by what they do: float32 spelled otherwise, the default overrides given again).
  assert as_module_policies(folded, {}, "f") is folded
  assert as_module_policies(folded, OPTIONS, "f") is folded
  assert as_module_policies(folded, {"grad_reduction_dtype": jnp.float32}, "f") is folded
  default = jlf.ModulePolicies(POLICY)
  same = {"overrides": None, "use_default_overrides": True, "explicit_dtypes": "warn"}
  assert as_module_policies(default, same, "f") is default
  assert as_module_policies(default, {"overrides": jlf.DEFAULT_OVERRIDES}, "f") is default


@pytest.mark.parametrize(
  "options, named",
  [
    ({"fp32_softmax": True}, "fp32_softmax=True"),
    ({"overrides": {nn.Dense: "bf16"}}, "overrides={<class 'flax.linen.linear.Dense'>: 'bf16'}"),
    ({"overrides": None}, "overrides=None"),
    ({"use_default_overrides": True}, "use_default_overrides=True"),
    ({"grad_reduction_dtype": None}, "grad_reduction_dtype=None"),
    ({"explicit_dtypes": "warn"}, "explicit_dtypes='warn'"),
    # Only the keywords that conflict are named.
    ({"fp32_softmax": False, "explicit_dtypes": "policy"}, "explicit_dtypes='policy' conflicts"),
  ],
)
def test_keywords_that_conflict_with_a_module_policies_are_refused(options, named):
  policies = jlf.ModulePolicies(POLICY, **OPTIONS)
  with pytest.raises(ValueError) as error:
    as_module_policies(policies, options, "policy_view")
  message = str(error.value)
  assert message.startswith(f"policy_view: {named}"), message
  assert "conflicts with the ModulePolicies passed as policy (ModulePolicies(" in message


@pytest.mark.parametrize(
  "policy, options, error, match",
  [
    (POLICY, {"fp32_softmx": False}, TypeError,
     r"policy_apply got unexpected keyword argument\(s\) 'fp32_softmx'; its options are "
     "overrides, use_default_overrides, fp32_accumulation"),
    (3, {}, TypeError, "policy_apply expects a policy: .* got 3 of type int"),
    ({"compute": "bf16"}, {}, TypeError, "got {'compute': 'bf16'} of type dict"),
    (POLICY, {"fp32_softmax": "no"}, TypeError, "fp32_softmax must be a bool, got 'no'"),
    (POLICY, {"fp32_accumulation": 1}, TypeError, "fp32_accumulation must be a bool, got 1"),
    (POLICY, {"use_default_overrides": None}, TypeError,
     "use_default_overrides must be a bool, got None"),
    (POLICY, {"grad_reduction_dtype": "bf16"}, ValueError,
     "grad_reduction_dtype must be None .* or float32, got 'bf16'"),
  ],
)  # fmt: skip
def test_entry_point_arguments_are_validated_in_one_place(policy, options, error, match):
  with pytest.raises(error, match=match):
    as_module_policies(policy, options, "policy_apply")


def test_explicit_module_dtypes_are_kept_or_replaced():
  policies = jlf.ModulePolicies(POLICY)  # explicit_dtypes="warn"
  dense = policies.resolve(nn.Dense, None, F32)
  # Kept: an fp32 island (params read unrounded, fp32 in), bf16 handed on, no 16-bit kernels.
  assert (dense.compute_dtype, dense.output_dtype, dense.root_output_dtype) == (F32, BF16, F32)
  assert (dense.policy_dtype, dense.explicit_dtype, dense.hooks) == (BF16, F32, ())
  # Inside it, a module without a dtype inherits fp32; one with fp32 is named too.
  inner = policies.resolve(nn.Dense, dense)
  assert (inner.compute_dtype, inner.policy_dtype, inner.explicit_dtype) == (F32, BF16, None)
  assert policies.resolve(nn.Dense, dense, F32).explicit_dtype == F32
  # No conflict where the module's dtype is the policy's (the LayerNorm override is fp32).
  assert policies.resolve(nn.LayerNorm, None, F32).explicit_dtype is None
  assert policies.resolve(nn.Dense, None, BF16).explicit_dtype is None
  assert jlf.ModulePolicies("f32").resolve(nn.Dense, None, F32).explicit_dtype is None
  # A bf16 LayerNorm conflicts with its fp32 override: kept in bf16 (nothing to recompute).
  norm = policies.resolve(nn.LayerNorm, None, BF16)
  assert (norm.compute_dtype, norm.explicit_dtype, norm.recompute) == (BF16, BF16, False)
  assert "dtype" not in policies.attribute_updates(nn.Dense(3, dtype=jnp.float32))
  # "policy": the policy's compute dtype, set as the module's dtype, with the kernels.
  wins = jlf.ModulePolicies(POLICY, explicit_dtypes="policy")
  assert wins.resolve(nn.Dense, None, F32)[:2] == (BF16, BF16)
  assert wins.attribute_updates(nn.Dense(3, dtype=jnp.float32)) == {
    "dot_general": jlf.dot_general,
    "dtype": BF16,
  }
  linear = nnx.Linear(2, 3, dtype="bfloat16", rngs=nnx.Rngs(0))
  assert jlf.ModulePolicies("f32", explicit_dtypes="policy").attribute_updates(linear) == {
    "dtype": F32
  }
  # A ModulePolicy that sets dtype decides for its class: no conflict to report.
  user = jlf.ModulePolicies(POLICY, {nn.Dense: jlf.ModulePolicy(attributes={"dtype": F32})})
  assert user.resolve(nn.Dense, None, F32).explicit_dtype is None
  assert jlf.ModulePolicies(POLICY) != jlf.ModulePolicies(POLICY, explicit_dtypes="keep")
  with pytest.raises(ValueError, match="explicit_dtypes must be one of 'warn', 'keep', 'policy'"):
    jlf.ModulePolicies(POLICY, explicit_dtypes="error")


@pytest.mark.parametrize(
  "module, expected",
  [
    (nn.Dense(3), None),
    (nn.Dense(3, dtype=jnp.float32), F32),
    (nn.Dense(3, dtype="bfloat16"), BF16),
    (nnx.Linear(2, 3, dtype=jnp.float16, rngs=nnx.Rngs(0)), F16),
    (nn.Embed(4, 3, dtype=jnp.int32), None),  # not a floating dtype: not a compute dtype
    (nn.Dropout(0.1), None),  # no dtype attribute
  ],
)
def test_explicit_dtype_reads_the_dtype_attribute(module, expected):
  assert explicit_dtype(module) == expected


class FlaxExamplesModel(nn.Module):
  """As Flax's examples write a model: a dtype field, fp32 by default, handed to every layer."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, dtype=self.dtype)(x)


class NnxExamplesModel(nnx.Module):
  def __init__(self, dtype=jnp.float32, *, rngs: nnx.Rngs):
    self.dtype = dtype
    self.dense = nnx.Linear(3, 2, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)


def _location(record) -> tuple[str, int]:
  """Where the one ExplicitDtypeWarning in ``record`` points."""
  (warning,) = [w for w in record if w.category is jlf.ExplicitDtypeWarning]
  return warning.filename, warning.lineno


# transform(f)(*args) traces f with no frame of this file between the call and JAX.
@pytest.mark.parametrize(
  "transform",
  [jax.jit, functools.partial(functools.partial, jax.eval_shape)],
  ids=["jit", "eval_shape"],
)
def test_explicit_dtype_warning_points_at_the_users_call(transform):
  # Traced by jax.jit or jax.eval_shape (as MaxText initializes), an entry point is
  # called by JAX's tracing machinery; the warning names the line that called JAX.
  model, x, key = FlaxExamplesModel(), jnp.ones((1, 3)), jax.random.key(0)
  init, apply = jlf.policy_init(model, POLICY), jlf.policy_apply(model, POLICY)
  with pytest.warns(jlf.ExplicitDtypeWarning) as record:
    line = inspect.currentframe().f_lineno + 1
    variables = transform(init)(key, x)
  assert _location(record) == (__file__, line)
  with pytest.warns(jlf.ExplicitDtypeWarning) as record:
    line = inspect.currentframe().f_lineno + 1
    transform(apply)(variables, x)
  assert _location(record) == (__file__, line)
  # Inside a differentiated loss: the loss's call of apply_fn.
  loss = lambda v: apply(v, x).sum()
  line = inspect.currentframe().f_lineno - 1
  with pytest.warns(jlf.ExplicitDtypeWarning) as record:
    transform(jax.grad(loss))(variables)
  assert _location(record) == (__file__, line)
  view = lambda: jlf.policy_view(NnxExamplesModel(rngs=nnx.Rngs(0)), POLICY)(x)
  line = inspect.currentframe().f_lineno - 1
  with pytest.warns(jlf.ExplicitDtypeWarning) as record:
    transform(view)()
  assert _location(record) == (__file__, line)


def test_explicit_dtype_warning_tells_a_class_default_from_a_dtype_passed():
  x = jnp.ones((1, 3))
  init = lambda model: jlf.policy_init(model, POLICY)(jax.random.key(0), x)
  # The model's dtype is its field's default, never passed; its Dense is built with one.
  (message,) = explicit_dtype_warnings(jax.eval_shape, lambda: init(FlaxExamplesModel()))
  assert message.startswith("policy_init: 2 module(s) have a dtype other than the compute dtype")
  assert "(the model) (FlaxExamplesModel: its class default dtype=float32, policy: bfloat16)" in (
    message
  )
  assert "Dense_0 (Dense: built with dtype=float32, policy: bfloat16)" in message
  assert "drop dtype= where these modules are built and make dtype=None the class default" in (
    message
  )
  (message,) = explicit_dtype_warnings(
    jax.eval_shape, lambda: init(FlaxExamplesModel(dtype=jnp.float16))
  )
  assert "(the model) (FlaxExamplesModel: built with dtype=float16, policy: bfloat16)" in message
  assert "class default" not in message and "explicit_dtypes='keep'" in message
  # NNX: the __init__ default is a class default; a layer's attribute may have been set by
  # its class (nnx.Embed takes its param_dtype), so it is named as the attribute it is.
  view = lambda model: jlf.policy_view(model, POLICY)
  (message,) = explicit_dtype_warnings(view, NnxExamplesModel(rngs=nnx.Rngs(0)))
  assert message.startswith("policy_view: 2 module(s)")
  assert "(the model) (NnxExamplesModel: its class default dtype=float32, policy: bfloat16)" in (
    message
  )
  assert "dense (Linear: dtype=float32, policy: bfloat16)" in message
