import dataclasses
import functools
import inspect
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax

import jmp_lite as jl
import jmp_lite.flax as jlf
from jmp_lite.flax._module_policy import as_module_policies
from jmp_lite.flax._resolved_precision import attribute_updates, explicit_dtype, resolve

from .flax_testing import BF16, F16, F32, explicit_dtype_warnings

POLICY = "p=f32,c=bf16,o=f32"


class MyNorm(nn.LayerNorm):
  pass


def test_module_override_parses_and_validates():
  mp = jlf.ModuleOverride(compute_dtype="f32", output_dtype=jnp.bfloat16, attributes={"x": 1})
  assert (mp.compute_dtype, mp.output_dtype) == (F32, BF16)
  assert mp == jlf.ModuleOverride(F32, "bf16", {"x": 1}) and hash(mp) == hash(
    jlf.ModuleOverride(F32, "bf16", {"x": 1})
  )
  assert mp != jlf.ModuleOverride(F32, "bf16", {"x": 2})
  with pytest.raises(TypeError):
    mp.attributes["y"] = 2  # read-only
  with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'recompute'"):
    mp.recompute = True
  with pytest.raises(ValueError, match="Unknown dtype name 'f33'"):
    jlf.ModuleOverride(compute_dtype="f33")
  with pytest.raises(ValueError, match="fp8"):
    jlf.ModuleOverride(compute_dtype="e4m3")
  with pytest.raises(TypeError, match="not a floating-point"):
    jlf.ModuleOverride(output_dtype="int8")
  with pytest.raises(TypeError, match="mapping"):
    jlf.ModuleOverride(attributes=[("x", 1)])
  with pytest.raises(TypeError, match="identifiers"):
    jlf.ModuleOverride(attributes={"not valid": 1})
  with pytest.raises(TypeError, match="recompute must be a bool"):
    jlf.ModuleOverride(recompute="yes")


def test_defaults_keep_normalization_and_embeddings_in_fp32():
  policies = jlf.ModulePolicies(POLICY)
  for cls in (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, nnx.LayerNorm, nnx.BatchNorm,
              nnx.GroupNorm, nnx.RMSNorm, nn.Embed, nnx.Embed):  # fmt: skip
    resolved = resolve(policies, cls)
    assert resolved.compute_dtype == F32, cls
    # Islands hand their result back in the compute dtype.
    assert resolved.output_dtype == BF16 and resolved.root_output_dtype == F32
  assert resolve(policies, nn.LayerNorm).recompute and resolve(policies, nnx.RMSNorm).recompute
  # BatchNorm updates running statistics: it cannot be recomputed.
  assert not resolve(policies, nn.BatchNorm).recompute
  assert not resolve(policies, nnx.BatchNorm).recompute
  dense = resolve(policies, nn.Dense)
  assert (dense.compute_dtype, dense.output_dtype, dense.root_output_dtype) == (BF16, BF16, F32)


def test_overrides_merge_replace_and_remove_defaults():
  policies = jlf.ModulePolicies(
    POLICY,
    {nn.Dense: "f32", nn.LayerNorm: None, nn.Conv: jlf.ModuleOverride(output_dtype="f16")},
  )
  assert resolve(policies, nn.Dense).compute_dtype == F32
  assert resolve(policies, nn.LayerNorm).compute_dtype == BF16  # default removed
  assert resolve(policies, nn.BatchNorm).compute_dtype == F32  # other defaults kept
  conv = resolve(policies, nn.Conv)
  assert (conv.compute_dtype, conv.output_dtype, conv.root_output_dtype) == (BF16, F16, F16)
  assert policies.overrides[nn.LayerNorm] is None
  bare = jlf.ModulePolicies(POLICY, use_default_overrides=False)
  assert resolve(bare, nn.LayerNorm).compute_dtype == BF16
  assert dict(bare.overrides) == {}
  # None: no overrides given (the defaults apply).
  assert jlf.ModulePolicies(POLICY, None) == jlf.ModulePolicies(POLICY)
  assert resolve(jlf.ModulePolicies(POLICY, None), nn.LayerNorm).compute_dtype == F32


def test_most_specific_class_wins():
  policies = jlf.ModulePolicies(POLICY)
  assert resolve(policies, MyNorm).compute_dtype == F32  # inherits LayerNorm's override
  policies = jlf.ModulePolicies(POLICY, {MyNorm: "f16"})
  assert resolve(policies, MyNorm).compute_dtype == F16
  assert resolve(policies, nn.LayerNorm).compute_dtype == F32
  # None: no override for the subclass, although its base has one.
  assert resolve(jlf.ModulePolicies(POLICY, {MyNorm: None}), MyNorm).compute_dtype == BF16


def test_modules_without_override_inherit_the_enclosing_one():
  policies = jlf.ModulePolicies(POLICY, {nn.Sequential: "f32"})
  block = resolve(policies, nn.Sequential)
  assert (block.compute_dtype, block.output_dtype) == (F32, BF16)
  dense = resolve(policies, nn.Dense, block)
  assert (dense.compute_dtype, dense.output_dtype, dense.hooks) == (F32, F32, ())
  norm = resolve(policies, nn.LayerNorm, block)  # an fp32 island inside an fp32 block
  assert (norm.compute_dtype, norm.output_dtype, norm.recompute) == (F32, F32, False)
  half = resolve(policies, nn.Dense, resolve(policies, nn.Dense))
  assert (half.compute_dtype, half.output_dtype) == (BF16, BF16)
  assert [(h.cls, h.attribute, h.replacement) for h in half.hooks] == [
    (nn.Dense, "dot_general", jlf.dot_general)
  ]


def test_recompute_only_for_islands():
  # Under an fp32 policy a LayerNorm is not an island: nothing to save by recomputing.
  assert not resolve(jlf.ModulePolicies("f32"), nn.LayerNorm).recompute
  assert resolve(jlf.ModulePolicies(POLICY), nn.LayerNorm).recompute


@pytest.mark.parametrize(
  "overrides, error, match",
  [
    ({"Dense": "f32"}, TypeError, "module classes, got 'Dense'"),
    ({int: "f32"}, TypeError, "module classes"),
    ({nn.Dense: jl.get_policy("f32")}, TypeError, "is a Policy; use ModuleOverride"),
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
  assert attribute_updates(policies, nn.Dense(3)) == {"dot_general": jlf.dot_general}
  custom = lambda *a, **k: lax.dot_general(*a, **k)
  assert attribute_updates(policies, nn.Dense(3, dot_general=custom)) == {}
  assert attribute_updates(policies, nn.Dense(3, dot_general_cls=lambda: custom)) == {}
  assert attribute_updates(policies, nn.Conv(3, (3, 3))) == {
    "conv_general_dilated": jlf.conv_general_dilated
  }
  mha = nn.MultiHeadDotProductAttention(num_heads=2)
  assert attribute_updates(policies, mha) == {"attention_fn": jlf.dot_product_attention}
  linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  assert attribute_updates(policies, linear) == {"dot_general": jlf.dot_general}
  einsum = nnx.Einsum("ab,bc->ac", (2, 3), rngs=nnx.Rngs(0))
  assert attribute_updates(policies, einsum) == {"einsum_op": jlf.einsum}
  # Switched off, or not computing in 16 bits: Flax's kernels stay.
  off = jlf.ModulePolicies(POLICY, fp32_accumulation=False, fp32_softmax=False)
  assert attribute_updates(off, nn.Dense(3)) == {} and attribute_updates(off, mha) == {}
  assert attribute_updates(jlf.ModulePolicies("f32"), nn.Dense(3)) == {}
  assert attribute_updates(jlf.ModulePolicies(POLICY, {nn.Dense: "f32"}), nn.Dense(3)) == {}


def test_user_attributes_beat_hooks_and_must_exist():
  policies = jlf.ModulePolicies(
    POLICY, {nn.Dense: jlf.ModuleOverride(attributes={"dot_general": lax.dot_general})}
  )
  assert attribute_updates(policies, nn.Dense(3)) == {"dot_general": lax.dot_general}
  policies = jlf.ModulePolicies(POLICY, {nn.Dense: jlf.ModuleOverride(attributes={"nope": 1})})
  with pytest.raises(AttributeError, match="'nope'"):
    attribute_updates(policies, nn.Dense(3))


def test_module_policies_are_values():
  a = jlf.ModulePolicies(POLICY, {nn.Dense: "f32"})
  # Equal and hashed alike whatever the spelling of the policy and of the override.
  for same in (
    jlf.ModulePolicies(jl.get_policy(POLICY), {nn.Dense: F32}),
    jlf.ModulePolicies(POLICY, {nn.Dense: jlf.FP32}),
  ):
    assert a == same and hash(a) == hash(same)
  assert a != jlf.ModulePolicies(POLICY)
  # Override keys are classes, compared by identity: another class of the same name differs.
  OtherDense = type("Dense", (nn.Dense,), {"__module__": nn.Dense.__module__})
  assert a != jlf.ModulePolicies(POLICY, {OtherDense: "f32"})
  # The policy, then the settings away from their defaults.
  assert repr(a) == (
    "ModulePolicies(p=f32,c=bf16,o=f32, overrides={Dense: ModuleOverride(compute_dtype="
    "dtype('float32'), output_dtype=None, attributes={}, recompute=False)})"
  )
  bare = jlf.ModulePolicies(POLICY, use_default_overrides=False, fp32_softmax=False)
  assert repr(bare) == (
    "ModulePolicies(p=f32,c=bf16,o=f32, use_default_overrides=False, fp32_softmax=False)"
  )
  # Compared by their settings; the defaults given by hand resolve as the defaults do.
  by_hand = jlf.ModulePolicies(POLICY, jlf.DEFAULT_OVERRIDES, use_default_overrides=False)
  assert by_hand != jlf.ModulePolicies(POLICY)
  for cls in jlf.DEFAULT_OVERRIDES:
    assert by_hand.module_override(cls) == jlf.ModulePolicies(POLICY).module_override(cls)
    assert resolve(by_hand, cls) == resolve(jlf.ModulePolicies(POLICY), cls)


def test_module_policies_is_a_frozen_dataclass():
  a = jlf.ModulePolicies(POLICY, {nn.Dense: "f32"})
  bare = jlf.ModulePolicies(POLICY, use_default_overrides=False, fp32_softmax=False)
  assert [f.name for f in dataclasses.fields(a)] == [
    "policy", "overrides", "use_default_overrides", "fp32_accumulation", "fp32_softmax",
    "op_table", "grad_reduction_dtype", "explicit_dtypes",
  ]  # fmt: skip
  with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field"):
    a.fp32_softmax = False
  with pytest.raises(TypeError, match="does not support item assignment"):
    a.overrides[nn.Conv] = jlf.FP32
  assert a.fp32_softmax is True and dict(a.overrides) == {nn.Dense: jlf.FP32}
  # A setting changed with dataclasses.replace, validated as in the constructor.
  changed = dataclasses.replace(a, fp32_softmax=False)
  assert changed == jlf.ModulePolicies(POLICY, {nn.Dense: "f32"}, fp32_softmax=False) != a
  assert dataclasses.replace(bare, fp32_softmax=True) == jlf.ModulePolicies(
    POLICY, use_default_overrides=False
  )
  with pytest.raises(TypeError, match="fp32_softmax must be a bool, got 'no'"):
    dataclasses.replace(a, fp32_softmax="no")


def test_module_policies_are_jit_static():
  # Equal ModulePolicies are one static argument: the function is traced once for both.
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def f(policies, x):
    traces.append(policies)
    return x.astype(policies.policy.compute_dtype)

  assert f(jlf.ModulePolicies(POLICY, {nn.Dense: "f32"}), jnp.ones(2)).dtype == BF16
  assert f(jlf.ModulePolicies(jl.get_policy(POLICY), {nn.Dense: F32}), jnp.ones(2)).dtype == BF16
  assert len(traces) == 1
  f(jlf.ModulePolicies(POLICY, {nn.Dense: "f16"}), jnp.ones(2))
  assert len(traces) == 2


def test_a_policy_means_module_policies_with_the_defaults():
  assert as_module_policies(POLICY, "policy_apply") == jlf.ModulePolicies(POLICY)
  assert as_module_policies(jl.get_policy(POLICY), "f") == jlf.ModulePolicies(POLICY)
  policies = jlf.ModulePolicies(POLICY, {nn.Dense: "f32"}, fp32_softmax=False)
  assert as_module_policies(policies, "f") is policies
  # Through the entry points: the same program for the string and for the ModulePolicies.
  model, x = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)]), jnp.ones((2, 3))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  program = lambda policy: str(jax.make_jaxpr(jlf.policy_apply(model, policy))(variables, x))
  assert program(POLICY) == program(jlf.ModulePolicies(POLICY)) != program(policies)


ENTRY_POINTS = {
  "policy_apply": lambda **kw: jlf.policy_apply(nn.Dense(3), POLICY, **kw),
  "policy_init": lambda **kw: jlf.policy_init(nn.Dense(3), POLICY, **kw),
  "policy_view": lambda **kw: jlf.policy_view(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), POLICY, **kw),
}


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_entry_points_refuse_option_keywords(entry_point):
  # Options are set on a ModulePolicies only: a keyword is named, with the object to build.
  first = "module" if entry_point != "policy_view" else "model"
  with pytest.raises(TypeError) as error:
    ENTRY_POINTS[entry_point](overrides={nn.Dense: "f32"}, fp32_softmax=False)
  assert str(error.value) == (
    f"{entry_point}() got unexpected keyword argument(s) 'overrides', 'fp32_softmax': it "
    f"takes ({first}, policy), and options go on the policy: {entry_point}(..., "
    "jl.flax.ModulePolicies(policy, overrides=..., fp32_softmax=...)). ModulePolicies takes "
    "overrides, use_default_overrides, fp32_accumulation, fp32_softmax, op_table, "
    "grad_reduction_dtype, explicit_dtypes."
  )
  # A keyword that is no option either: named, with what ModulePolicies takes.
  with pytest.raises(TypeError) as error:
    ENTRY_POINTS[entry_point](fp32_softmx=False)
  assert str(error.value) == (
    f"{entry_point}() got unexpected keyword argument(s) 'fp32_softmx': it takes ({first}, "
    "policy), and options go on the policy. ModulePolicies takes overrides, "
    "use_default_overrides, fp32_accumulation, fp32_softmax, op_table, grad_reduction_dtype, "
    "explicit_dtypes."
  )


def test_entry_points_keep_their_signature():
  # The keyword check leaves the documented signature (and the docstring) in place.
  assert list(inspect.signature(jlf.policy_apply).parameters) == ["module", "policy"]
  assert list(inspect.signature(jlf.policy_init).parameters) == ["module", "policy"]
  assert list(inspect.signature(jlf.policy_view).parameters) == ["model", "policy"]
  assert jlf.policy_apply.__doc__.startswith("Returns ``module.apply`` running under ``policy``")


@pytest.mark.parametrize(
  "make, error, match",
  [
    (lambda: as_module_policies(3, "policy_apply"), TypeError,
     "policy_apply expects a policy: .* got 3 of type int"),
    (lambda: as_module_policies({"compute": "bf16"}, "policy_apply"), TypeError,
     "got {'compute': 'bf16'} of type dict"),
    (lambda: jlf.ModulePolicies(3), TypeError,
     "ModulePolicies expects a jmp_lite.Policy or a policy string, got 3"),
    (lambda: jlf.ModulePolicies(POLICY, fp32_softmax="no"), TypeError,
     "fp32_softmax must be a bool, got 'no'"),
    (lambda: jlf.ModulePolicies(POLICY, fp32_accumulation=1), TypeError,
     "fp32_accumulation must be a bool, got 1"),
    (lambda: jlf.ModulePolicies(POLICY, use_default_overrides=None), TypeError,
     "use_default_overrides must be a bool, got None"),
    (lambda: jlf.ModulePolicies(POLICY, op_table="yes"), TypeError,
     "op_table must be a bool, got 'yes'"),
    (lambda: jlf.ModulePolicies(POLICY, grad_reduction_dtype="bf16"), ValueError,
     "grad_reduction_dtype must be None .* or float32, got 'bf16'"),
    (lambda: jlf.ModulePolicies(POLICY, fp32_accumulation=False, grad_reduction_dtype="f32"),
     ValueError, "grad_reduction_dtype needs jmp_lite's kernels"),
  ],
)  # fmt: skip
def test_module_policies_arguments_are_validated(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_explicit_module_dtypes_are_kept_or_replaced():
  policies = jlf.ModulePolicies(POLICY)  # explicit_dtypes="warn"
  dense = resolve(policies, nn.Dense, None, F32)
  # Kept: an fp32 island (params read unrounded, fp32 in), bf16 handed on, no 16-bit kernels.
  assert (dense.compute_dtype, dense.output_dtype, dense.root_output_dtype) == (F32, BF16, F32)
  assert (dense.policy_dtype, dense.explicit_dtype, dense.hooks) == (BF16, F32, ())
  # Inside it, a module without a dtype inherits fp32; one with fp32 is named too.
  inner = resolve(policies, nn.Dense, dense)
  assert (inner.compute_dtype, inner.policy_dtype, inner.explicit_dtype) == (F32, BF16, None)
  assert resolve(policies, nn.Dense, dense, F32).explicit_dtype == F32
  # No conflict where the module's dtype is the policy's (the LayerNorm override is fp32).
  assert resolve(policies, nn.LayerNorm, None, F32).explicit_dtype is None
  assert resolve(policies, nn.Dense, None, BF16).explicit_dtype is None
  assert resolve(jlf.ModulePolicies("f32"), nn.Dense, None, F32).explicit_dtype is None
  # A bf16 LayerNorm conflicts with its fp32 override: kept in bf16 (nothing to recompute).
  norm = resolve(policies, nn.LayerNorm, None, BF16)
  assert (norm.compute_dtype, norm.explicit_dtype, norm.recompute) == (BF16, BF16, False)
  assert "dtype" not in attribute_updates(policies, nn.Dense(3, dtype=jnp.float32))
  # "policy": the policy's compute dtype, set as the module's dtype, with the kernels.
  wins = jlf.ModulePolicies(POLICY, explicit_dtypes="policy")
  assert resolve(wins, nn.Dense, None, F32)[:2] == (BF16, BF16)
  assert attribute_updates(wins, nn.Dense(3, dtype=jnp.float32)) == {
    "dot_general": jlf.dot_general,
    "dtype": BF16,
  }
  linear = nnx.Linear(2, 3, dtype="bfloat16", rngs=nnx.Rngs(0))
  assert attribute_updates(jlf.ModulePolicies("f32", explicit_dtypes="policy"), linear) == {
    "dtype": F32
  }
  # A ModulePolicy that sets dtype decides for its class: no conflict to report.
  user = jlf.ModulePolicies(POLICY, {nn.Dense: jlf.ModuleOverride(attributes={"dtype": F32})})
  assert resolve(user, nn.Dense, None, F32).explicit_dtype is None
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
  [jax.jit, functools.partial(functools.partial, jax.eval_shape), eqx.filter_jit],
  ids=["jit", "eval_shape", "eqx_filter_jit"],
)
def test_explicit_dtype_warning_points_at_the_users_call(transform):
  # Traced by jax.jit or jax.eval_shape (as MaxText initializes) or eqx.filter_jit, an entry
  # point is called by JAX's (or Equinox's) tracing machinery; the warning names the line that
  # called the transform.
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
