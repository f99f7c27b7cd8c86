"""The op table inside Flax models: the operations a model writes itself, under the entry points.

The class table casts what enters and leaves each Flax module; a model's own code (MaxText-style
einsum attention with ``jax.nn.softmax``, ``nn.dot_product_attention`` called as a function, a
hand-written RMSNorm) runs at the dtype its inputs have. With ``op_table=True`` (the default)
``policy_apply``/``policy_view`` run those operations as ``jl.autocast`` does: ``exp``, ``rsqrt``
and long sums in fp32, the rest as written.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite.flax as jlf

from .flax_testing import (
  BF16,
  F16,
  F32,
  VOCAB,
  WIDTH,
  LinenLM,
  eqns,
  linen_init,
  lm_loss,
  primitive_dtypes,
  rel_error,
  tokens,
)

# The operations the op table computes in fp32 (what a 16-bit policy must not run in 16 bits).
FP32_OPS = ("exp", "rsqrt", "reduce_sum")


class RMSNorm(nn.Module):
  """A norm the class table does not know: MaxText writes its own."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * scale


class EinsumAttention(nn.Module):
  """Attention written with einsums and ``jax.nn.softmax``, or ``nn.dot_product_attention``."""

  flax_function: bool = False

  @nn.compact
  def __call__(self, x, mask):
    heads, depth = 2, x.shape[-1] // 2
    q, k, v = (nn.DenseGeneral((heads, depth), name=name)(x) for name in "qkv")
    if self.flax_function:
      out = nn.dot_product_attention(q, k, v, mask=mask)
    else:
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(depth).astype(q.dtype)
      logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
      out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out")(out)


class Decoder(nn.Module):
  flax_function: bool = False

  @nn.compact
  def __call__(self, toks):
    x = nn.Embed(VOCAB, WIDTH)(toks)
    x = x + EinsumAttention(self.flax_function)(RMSNorm()(x), nn.make_causal_mask(toks))
    x = x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(RMSNorm()(x))))
    return nn.Dense(VOCAB)(RMSNorm()(x))


def _forward_dtypes(apply_fn, variables, toks) -> dict[str, set]:
  jaxpr = jax.make_jaxpr(lambda v: apply_fn(v, toks))(variables)
  return {name: primitive_dtypes(jaxpr, name) for name in FP32_OPS}


@pytest.mark.parametrize("flax_function", [False, True], ids=["einsum_softmax", "flax_function"])
@pytest.mark.parametrize("policy", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"])
def test_a_models_own_softmax_and_norm_run_in_fp32(flax_function, policy):
  model, toks = Decoder(flax_function), tokens()
  variables = linen_init(model, jax.random.key(0), toks)
  narrow = F16 if "c=f16" in policy else BF16
  census = _forward_dtypes(jlf.policy_apply(model, policy), variables, toks)
  assert census == {name: {F32} for name in FP32_OPS}, census  # each one present, all fp32
  # The test can fail: without the op table the softmax and the norm run in 16 bits.
  census = _forward_dtypes(
    jlf.policy_apply(model, jlf.ModulePolicies(policy, op_table=False)), variables, toks
  )
  assert narrow in census["exp"] and narrow in census["rsqrt"], census

  # Matmuls still take the operands their modules give them: all 16-bit but the fp32 logits.
  jaxpr = jax.make_jaxpr(lambda v: jlf.policy_apply(model, policy)(v, toks))(variables)
  dots = [e for e in eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert {tuple(np.dtype(v.aval.dtype) for v in e.invars) for e in dots} == {(narrow, narrow)}


@pytest.mark.parametrize("policy", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"])
def test_outputs_and_gradients_against_fp32_no_worse_than_without_the_table(policy):
  model, toks = Decoder(), tokens()
  variables = linen_init(model, jax.random.key(0), toks)

  def loss_and_grads(apply_fn):
    return jax.jit(jax.value_and_grad(lambda v: lm_loss(apply_fn(v, toks), toks)))(variables)

  reference = loss_and_grads(model.apply)
  with_table = loss_and_grads(jlf.policy_apply(model, policy))
  without = loss_and_grads(jlf.policy_apply(model, jlf.ModulePolicies(policy, op_table=False)))
  assert jax.tree.map(lambda g: g.dtype, with_table[1]) == jax.tree.map(
    lambda g: g.dtype, reference[1]
  )
  for part in (0, 1):
    ours, theirs = (
      _norm_error(with_table[part], reference[part]),
      _norm_error(without[part], reference[part]),
    )
    # Within 16-bit noise of fp32. At this size the matmuls' rounding dominates both errors
    # (jax.nn.softmax sums in fp32 either way), so "no worse" allows for that noise: over
    # seeds 0-3 the ratio is 0.1x-1.12x.
    assert ours < 2e-2, (part, ours)
    assert ours <= 1.15 * theirs + 1e-4, (part, ours, theirs)


def _norm_error(ours, reference) -> float:
  """``||ours - reference|| / ||reference||`` over all leaves of a pytree together."""
  flat = lambda tree: np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)]
  )
  a, b = flat(ours), flat(reference)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class LogSoftmaxHead(nn.Module):
  """A hand-written log-softmax: ``exp`` of logits above 11 overflows fp16 (max 65504)."""

  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(VOCAB)(x)
    return logits - jnp.log(jnp.sum(jnp.exp(logits), axis=-1, keepdims=True))


def test_fp16_hand_written_log_softmax_overflows_only_without_the_table():
  model = LogSoftmaxHead()
  x = 6.0 * jax.random.normal(jax.random.key(1), (4, WIDTH))
  variables = linen_init(model, jax.random.key(0), x)
  reference = model.apply(variables, x)
  assert float(jnp.max(jnp.abs(x @ variables["params"]["Dense_0"]["kernel"]))) > 11.1
  ours = jlf.policy_apply(model, "p=f32,c=f16,o=f32")(variables, x)
  np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-2)
  without = jlf.policy_apply(model, jlf.ModulePolicies("p=f32,c=f16,o=f32", op_table=False))(
    variables, x
  )
  assert not np.all(np.isfinite(without))


def test_models_without_own_operations_are_unchanged():
  """The class table's model (Flax modules only): the table changes nothing, bit for bit."""
  model, toks = LinenLM(), tokens()
  variables = linen_init(model, jax.random.key(0), toks)

  def step(**options):
    apply_fn = jlf.policy_apply(model, jlf.ModulePolicies("p=f32,c=bf16,o=f32", **options))
    return jax.jit(jax.value_and_grad(lambda v: lm_loss(apply_fn(v, toks), toks)))(variables)

  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), step(), step(op_table=False))
  assert jax.tree.all(same), same


class NnxRMSNorm(nnx.Module):
  def __init__(self, width: int):
    self.scale = nnx.Param(jnp.ones((width,)))

  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * self.scale


class NnxDecoder(nnx.Module):
  """Einsum attention with ``jax.nn.softmax``, dropout and BatchNorm: state the call updates."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.norm = NnxRMSNorm(WIDTH)
    self.qk = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.bn = nnx.BatchNorm(WIDTH, momentum=0.5, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, toks):
    x = self.embed(toks)
    q, k = jnp.split(self.qk(self.norm(x)), 2, axis=-1)
    logits = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH).astype(q.dtype)
    logits = jnp.where(nnx.make_causal_mask(toks)[:, 0], logits, jnp.finfo(logits.dtype).min)
    x = x + self.drop(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(logits, axis=-1), x))
    return self.head(self.bn(x))


def test_nnx_view_runs_the_models_own_operations_in_fp32_and_updates_its_state():
  toks = tokens()
  results = {}
  for op_table in (True, False):
    model = NnxDecoder(rngs=nnx.Rngs(0, dropout=1))

    def loss(model, op_table=op_table):
      policies = jlf.ModulePolicies("p=f32,c=bf16,o=f32", op_table=op_table)
      return lm_loss(jlf.policy_view(model, policies)(toks), toks)

    graphdef, state = nnx.split(model)
    census = jax.make_jaxpr(lambda s, graphdef=graphdef: loss(nnx.merge(graphdef, s)))(state)
    results[op_table] = {
      "census": {name: primitive_dtypes(census, name) for name in FP32_OPS},
      "loss_grads": nnx.jit(nnx.value_and_grad(loss))(model),
      "mean": np.asarray(model.bn.mean[...]),
      "count": int(model.drop.rngs.count[...]),
    }
  assert results[True]["census"] == {name: {F32} for name in FP32_OPS}
  assert BF16 in results[False]["census"]["exp"] | results[False]["census"]["rsqrt"]
  # The call updated the model's batch statistics and drew its dropout mask, as without the
  # table: the same RNG count, statistics within bf16 rounding.
  assert results[True]["count"] == results[False]["count"] == 1
  np.testing.assert_allclose(results[True]["mean"], results[False]["mean"], atol=2e-2)
  assert np.any(results[True]["mean"] != 0)
  loss, grads = results[True]["loss_grads"]
  assert grads.norm.scale[...].dtype == F32 and np.isfinite(float(loss))
  assert rel_error(nnx.state(grads), nnx.state(results[False]["loss_grads"][1])) < 5e-2


def _scale_gradient_summed_in_fp32(x, w):
  """The gradient of ``sum(rmsnorm(x) * w)`` w.r.t. a bf16 scale, summed as the table sums it.

  ``x`` has entries +-1, so the normalized rows are ``x`` exactly (mean 1, ``rsqrt`` 1 in
  bf16); the cotangent reaching the product is ``w`` rounded to bf16 (the output cast's
  transpose). Their bf16 products summed over the rows in fp32, rounded once to bf16.
  """
  terms = (w.astype(jnp.bfloat16) * x.astype(jnp.bfloat16)).astype(F32)
  return terms.reshape(-1, x.shape[-1]).sum(0).astype(jnp.bfloat16).astype(F32)


def _norm_inputs():
  # 512 rows: a bf16 sum of them (8 significant bits) drops what the fp32 sum keeps.
  signs = jax.random.rademacher(jax.random.key(0), (4, 128, WIDTH), F32)
  return signs, jax.random.normal(jax.random.key(1), (4, 128, WIDTH))


def test_a_hand_written_norms_scale_gradient_sums_in_fp32_linen():
  model, (x, w) = RMSNorm(), _norm_inputs()
  variables = model.init(jax.random.key(0), x)

  def scale_grad(**options):
    apply_fn = jlf.policy_apply(model, jlf.ModulePolicies("p=f32,c=bf16,o=f32", **options))
    grads = jax.jit(jax.grad(lambda v: jnp.sum(apply_fn(v, x) * w)))(variables)
    return grads["params"]["scale"]

  expected = _scale_gradient_summed_in_fp32(x, w)
  ours = scale_grad()
  assert ours.dtype == F32
  np.testing.assert_array_equal(ours, expected)
  # The test can fail: without the table JAX sums the 512 bf16 products in bf16.
  assert not np.array_equal(scale_grad(op_table=False), expected)


def test_a_hand_written_norms_scale_gradient_sums_in_fp32_nnx():
  model, (x, w) = NnxRMSNorm(WIDTH), _norm_inputs()

  def scale_grad(op_table):
    policies = jlf.ModulePolicies("p=f32,c=bf16,o=f32", op_table=op_table)
    loss = lambda m: jnp.sum(jlf.policy_view(m, policies)(x) * w)
    return nnx.grad(loss)(model).scale[...]

  expected = _scale_gradient_summed_in_fp32(x, w)
  ours = scale_grad(True)
  assert ours.dtype == F32
  np.testing.assert_array_equal(ours, expected)
  assert not np.array_equal(scale_grad(False), expected)


def test_the_option_is_checked_and_part_of_the_configuration():
  policies = jlf.ModulePolicies("p=f32,c=bf16,o=f32")
  assert policies.op_table and policies != jlf.ModulePolicies(policies.policy, op_table=False)
  with pytest.raises(TypeError, match="op_table"):
    jlf.ModulePolicies("p=f32,c=bf16,o=f32", op_table="yes")
  with pytest.raises(TypeError, match=r"unexpected keyword argument.*'op_table'"):
    jlf.policy_apply(LinenLM(), policies, op_table=False)
