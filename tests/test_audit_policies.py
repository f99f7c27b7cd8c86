"""jl.audit on whole training steps: the policies it judges matmuls by, found with no configuration.

A float32 matmul in a bf16 model is found where the policy runs (the policy scope that
``policy_apply`` / ``policy_view`` put in the trace, kept through jit, grad, scan and remat),
where the step's arguments carry a policy it bypasses (``model.apply`` instead of
``state.apply_fn``), and in Equinox steps, whose results hold functions.
"""

import dataclasses
import pathlib

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_lite as jl
import jmp_lite.flax as jlf

BF16_POLICY = jl.get_policy("p=f32,c=bf16,o=f32")
_SOURCE = pathlib.Path(__file__).read_text().splitlines()
pytestmark = pytest.mark.filterwarnings("ignore::jmp_lite.flax.ExplicitDtypeWarning")


def line_of(marker: str) -> int:
  (line,) = [i + 1 for i, text in enumerate(_SOURCE) if f"# <{marker}>" in text]
  return line


def summary(report) -> list[tuple]:
  return [(f.check, f.dtype, f.scope, f.location.line, f.operands) for f in report]


class KeptMLP(nn.Module):
  """A model whose middle layer keeps an explicit dtype under any policy (None: follows it)."""

  kept_dtype: jnp.dtype | None = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8)(x))
    x = nn.relu(nn.Dense(8, dtype=self.kept_dtype)(x))  # <kept-fp32>
    return nn.Dense(2)(x)


X, Y = jnp.ones((4, 3)), jnp.array([0, 1, 0, 1])
MODEL = KeptMLP()
PARAMS = MODEL.init(jax.random.key(0), X)["params"]
KEPT = ("float32[4,8]", "float32[8,8]")  # the kept layer's operands


def cross_entropy(logits):
  return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()


def sgd_step(apply_fn):
  tx = optax.sgd(0.1)

  @jax.jit
  def step(params, opt_state, x):
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(apply_fn({"params": p}, x)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, tx.init(PARAMS)


def test_a_jitted_train_step_is_judged_by_the_policy_policy_apply_runs():
  step, opt_state = sgd_step(jlf.policy_apply(MODEL, BF16_POLICY))
  # No configuration: the step has no policy attribute, the jaxpr says where the policy ran.
  report = jl.audit(step, PARAMS, opt_state, X)
  assert summary(report) == [
    ("fp32_matmul", "bfloat16", "jvp(KeptMLP)/Dense_1", line_of("kept-fp32"), KEPT)
  ], str(report)
  assert "A layer built with dtype=jnp.float32" in report.findings[0].message
  # Built with Flax's default dtype=None, the layer follows the policy: nothing to report.
  step, opt_state = sgd_step(jlf.policy_apply(KeptMLP(kept_dtype=None), BF16_POLICY))
  assert not jl.audit(step, PARAMS, opt_state, X)


def test_each_policy_scope_is_judged_by_its_own_policy():
  def step(params, x):
    bf16 = jlf.policy_apply(MODEL, BF16_POLICY)({"params": params}, x)
    f16 = jlf.policy_apply(MODEL, "p=f32,c=f16,o=f32")({"params": params}, x)
    f32 = jlf.policy_apply(MODEL, "float32")({"params": params}, x)  # float32 is what it asks
    return bf16 + f16 + f32

  report = jl.audit(jax.jit(step), PARAMS, X)
  line = line_of("kept-fp32")
  assert summary(report) == [
    ("fp32_matmul", "bfloat16", "KeptMLP/Dense_1", line, KEPT),
    ("fp32_matmul", "float16", "KeptMLP/Dense_1", line, KEPT),
  ], str(report)
  # An explicit compute dtype judges the whole program.
  config = jl.AuditConfig(compute_dtype="float16")
  # Its float32 model runs three float32 matmuls.
  assert [f.dtype for f in jl.audit(step, PARAMS, X, audit_config=config)] == ["float16"] * 5


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(8, dtype=jnp.float32)(x), None  # <scanned-fp32>


class ScannedStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    blocks = nn.scan(
      nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
    )
    x, _ = blocks()(x, None)
    return nn.Dense(2)(x)


def test_the_policy_is_found_under_scan_and_remat():
  model = ScannedStack()
  params = model.init(jax.random.key(0), X)["params"]
  apply_fn = jlf.policy_apply(model, BF16_POLICY)
  step = jax.jit(jax.grad(lambda p, x: cross_entropy(apply_fn({"params": p}, x))))
  report = jl.audit(step, params, X)
  assert summary(report) == [
    (
      "fp32_matmul",
      "bfloat16",
      "jvp(ScannedStack)/ScanCheckpointBlock_0/Dense_0",
      line_of("scanned-fp32"),
      ("float32[4,8]", "float32[8,8]"),
    )
  ], str(report)


# What a step that runs MODEL with model.apply instead of its state's policy reports: every
# matmul in float32, judged by the policy's dtype.
BYPASSED = [
  ("fp32_matmul", "bfloat16", "jvp(KeptMLP)/Dense_0", ("float32[4,3]", "float32[3,8]")),
  ("fp32_matmul", "bfloat16", "jvp(KeptMLP)/Dense_1", KEPT),
  ("fp32_matmul", "bfloat16", "jvp(KeptMLP)/Dense_2", ("float32[4,8]", "float32[8,2]")),
]


def _train_state(tx):
  """A TrainState of MODEL under the bf16 policy (its apply_fn runs the policy)."""
  return jlf.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx, policy=BF16_POLICY)


def test_a_train_state_step_is_judged_by_the_states_policy():
  state = _train_state(optax.sgd(0.1))

  @jax.jit
  def step(state, x):
    loss, grads = state.value_and_grad(lambda p: cross_entropy(state.apply_fn({"params": p}, x)))(
      state.params
    )
    return state.apply_gradients(grads=grads), loss

  report = jl.audit(step, state, X)
  assert summary(report) == [
    ("fp32_matmul", "bfloat16", "jvp(KeptMLP)/Dense_1", line_of("kept-fp32"), KEPT)
  ], str(report)


def test_a_step_that_bypasses_the_states_policy_is_reported_as_such():
  state = _train_state(optax.sgd(0.1))

  @jax.jit
  def step(state, x):
    loss_fn = lambda p: cross_entropy(MODEL.apply({"params": p}, x))  # <bypass>
    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  report = jl.audit(step, state, X)
  # Every matmul of the model runs in float32, each reported, with the policy's dtype.
  assert [(f.check, f.dtype, f.scope, f.operands) for f in report] == BYPASSED, str(report)
  for finding in report:
    assert (
      "The arguments carry the policy p=f32,c=bf16,o=f32 (e.g. a jmp_lite.flax.TrainState's "
      "policy), but no jmp_lite policy runs in this step: the step bypasses it, e.g. calls "
      "model.apply instead of state.apply_fn"
    ) in finding.message
    assert "dtype=" not in finding.message  # no layer's dtype is to blame


def test_a_float32_matmul_outside_the_policy_is_named_as_outside_it():
  apply_fn = jlf.policy_apply(MODEL, BF16_POLICY)

  def step(policy, params, x, labels32):
    logits = apply_fn({"params": params}, x)
    return (logits @ labels32).sum()  # <outside>

  report = jl.audit(step, BF16_POLICY, PARAMS, X, jnp.ones((2, 5)))
  assert [(f.location.line, f.scope, f.operands) for f in report] == [
    (line_of("kept-fp32"), "KeptMLP/Dense_1", KEPT),
    (line_of("outside"), "", ("float32[4,2]", "float32[2,5]")),
  ], str(report)
  inside, outside = report.findings
  assert "A layer built with dtype=jnp.float32" in inside.message
  assert "It runs outside the policy p=f32,c=bf16,o=f32 that the arguments carry" in (
    outside.message
  )


def fp32_orthogonalized_sgd():
  """SGD on ``g @ g.T @ g``: an optimizer whose update runs float32 matmuls on purpose (the
  shape of Muon's Newton-Schulz iterations and Shampoo's preconditioners)."""

  def update(updates, state, params=None):
    del params
    f32 = lambda g: (g @ g.T @ g if g.ndim == 2 else g).astype(jnp.float32)  # <update-fp32>
    return jax.tree.map(f32, updates), state

  return optax.chain(
    optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.sgd(0.1)
  )


def policy_state_step(apply_fn, tx):
  state = _train_state(tx)

  @jax.jit
  def step(state, x):
    loss_fn = lambda p: cross_entropy(apply_fn(state)({"params": p}, x))
    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return step, state


@pytest.mark.parametrize("optimizer", ["fp32_orthogonalized_sgd", "muon"])
def test_an_optimizers_own_float32_matmuls_are_not_a_bypassed_policy(optimizer):
  tx = fp32_orthogonalized_sgd() if optimizer != "muon" else optax.contrib.muon(0.1)
  # Through the policy, a model whose layers follow it: the update's matmuls are the optimizer's.
  model = KeptMLP(kept_dtype=None)
  step, state = policy_state_step(lambda s: jlf.policy_apply(model, s.policy), tx)
  assert not jl.audit(step, state, X)
  # A step that bypasses the policy: the model's matmuls are reported, the update's are not.
  step, state = policy_state_step(lambda s: MODEL.apply, tx)
  report = jl.audit(step, state, X)
  assert [(f.check, f.dtype, f.scope, f.operands) for f in report] == BYPASSED, str(report)
  # An explicit compute dtype judges the whole program: the update's matmuls (two per kernel;
  # Muon's Newton-Schulz iterations, three per kernel), in the optimizer's code.
  config = jl.AuditConfig(compute_dtype="bfloat16", checks=["fp32_matmul"])
  step, state = policy_state_step(lambda s: jlf.policy_apply(model, s.policy), tx)
  report = jl.audit(step, state, X, audit_config=config)
  where = [(f.library_location or f.location).function for f in report]
  if optimizer == "muon":
    assert where == ["_base_newton_schulz_iteration"] * 9, str(report)
  else:
    assert where == ["fp32_orthogonalized_sgd.<locals>.update.<locals>.<lambda>"] * 6, str(report)
    assert {f.location.line for f in report} == {line_of("update-fp32")}


class NnxKept(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.head = nnx.Linear(8, 2, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.hidden(x)))  # <nnx-kept>


def test_an_nnx_step_is_judged_by_the_policy_policy_view_runs():
  model = NnxKept(nnx.Rngs(0))

  @nnx.jit
  def step(model, x):
    loss = lambda m: cross_entropy(jlf.policy_view(m, BF16_POLICY)(x))
    return nnx.grad(loss)(model)

  report = jl.audit(step, model, X)
  assert [(f.check, f.dtype, f.location.line, f.operands) for f in report] == [
    ("fp32_matmul", "bfloat16", line_of("nnx-kept"), ("float32[4,8]", "float32[8,2]"))
  ], str(report)


# --------------------------------------------------------------------------------------------
# Equinox: modules hold functions (activations) as leaves, in arguments and results.


def eqx_step(loss_dtype):
  tx = optax.sgd(0.1)

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    def loss_fn(model):
      model16 = BF16_POLICY.cast_to_compute(model)
      logits = jax.vmap(model16)(BF16_POLICY.cast_to_compute(x)).astype(loss_dtype)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()  # <eqx-loss>

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  return step, tx


def test_an_equinox_step_returning_the_module_is_audited():
  model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
  for loss_dtype, expected in [
    (jnp.bfloat16, [("logsumexp", "exp", "bfloat16", line_of("eqx-loss"))]),
    (jnp.float32, []),  # the loss from float32 logits, as the policy's output dtype says
  ]:
    step, tx = eqx_step(loss_dtype)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    report = jl.audit(step, model, opt_state, X, Y)
    assert [(f.check, f.primitive, f.dtype, f.location.line) for f in report] == expected
    # The matmuls run in bfloat16: judged by the policy, nothing to report either.
    config = jl.AuditConfig(compute_dtype="bfloat16", checks=["fp32_matmul"])
    assert not jl.audit(step, model, opt_state, X, Y, audit_config=config)


# --------------------------------------------------------------------------------------------
# Which arguments carry a policy


@dataclasses.dataclass(frozen=True)
class Holder:
  policy: jl.Policy
  other: object = None


def test_policies_in_finds_policies_in_arguments_fields_and_functions():
  from jmp_lite._audit._policies import policies_in

  f16 = jl.get_policy("p=f32,c=f16,o=f32")
  state = _train_state(optax.sgd(0.1))
  assert policies_in(((state, X), {})) == (BF16_POLICY,)  # a static field of the state
  # A Flax TrainState without a policy field, holding a policy_apply function.
  plain = jlf.TrainState.create(
    apply_fn=jlf.policy_apply(MODEL, f16), params=PARAMS, tx=optax.sgd(0.1)
  )
  assert policies_in(((plain,), {})) == (f16,)
  assert policies_in(((Holder(f16, [{"p": BF16_POLICY}]), f16), {})) == (f16, BF16_POLICY)
  # Objects that are neither containers, pytrees nor dataclasses are not looked into.
  opaque = type("Opaque", (), {"policy": BF16_POLICY})()
  assert policies_in(((opaque, PARAMS, 1.0, "train"), {"flag": True})) == ()
