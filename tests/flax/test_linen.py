import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl
import jmp_lite.flax as jlf

from .flax_testing import (
  BF16,
  F16,
  F32,
  VOCAB,
  LinenBlock,
  LinenConvNet,
  LinenLM,
  check_hlo_products,
  check_lean_products,
  eqns,
  explicit_dtype_warnings,
  images,
  in_dtypes,
  island_activation_dtypes,
  jit,
  lm_loss,
  out_dtype,
  primitive_dtypes,
  products,
  rel_error,
  tokens,
)

POLICY = "p=f32,c=bf16,o=f32"


@pytest.fixture(scope="module")
def lm():
  model, toks = LinenLM(), tokens()
  return model, toks, jit(model.init)(jax.random.key(0), toks)


def _shapes(fn, *args):
  """Abstract evaluation: dtypes and shapes without compiling anything."""
  return jax.eval_shape(fn, *args)


def test_transformer_matmuls_are_16_bit_and_islands_are_fp32(lm):
  model, toks, variables = lm
  apply = jlf.policy_apply(model, POLICY)
  grad = jax.grad(lambda p: lm_loss(apply({"params": p}, toks), toks))
  jaxpr = jax.make_jaxpr(grad)(variables["params"])
  # 9 forward products (q, k, v, out, MLP up/down, head, 2 in attention) and
  # 19 backward ones (dx and dW of the 7 dense ones, 2 for each attention product,
  # the softmax backward's row sums <dp, p>), all 16-bit like Flax's dtype=bf16
  # layers, except two with fp32 results: the head's forward product (the model's
  # output, fp32 logits for the loss) and the row sums.
  assert check_lean_products(jaxpr, wide=2) == 9 + 19
  hlo = jax.jit(grad).lower(variables["params"]).as_text()
  assert check_hlo_products(hlo, wide=2) == 9 + 19
  wide = [
    e.outvars[0].aval.shape for e in products(jaxpr) if out_dtype(e) == F32 and BF16 in in_dtypes(e)
  ]
  assert sorted(wide) == [(2, 2, 8), (2, 8, VOCAB)]  # row sums [batch, heads, q]; the logits
  # fp32 islands: attention softmax and cross-entropy (exp, max, log),
  # LayerNorm statistics (rsqrt of the variance), in the backward pass too.
  for name in ("exp", "log", "rsqrt", "reduce_max"):
    assert primitive_dtypes(jaxpr, name) == {F32}, name
  # Without jmp_lite the same model under a bf16 cast has 16-bit islands.
  plain = jax.make_jaxpr(
    lambda p: lm_loss(
      model.apply({"params": jax.tree.map(lambda x: x.astype(BF16), p)}, toks), toks
    )
  )(variables["params"])
  assert BF16 in primitive_dtypes(plain, "exp")  # Flax's own softmax follows its input


def test_every_module_output_has_its_dtype(lm):
  model, toks, variables = lm
  apply = jlf.policy_apply(model, POLICY)
  out, state = _shapes(
    lambda v: apply(v, toks, capture_intermediates=True, mutable=["intermediates"]), variables
  )
  assert out.dtype == F32  # the outermost call returns the policy's output dtype
  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]:
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    found["/".join(names)] = leaf.dtype
  assert found.pop("__call__") == F32
  # The head computes the model's output: fp32 logits straight from its matmul.
  assert found.pop("Dense_0/__call__") == F32
  # Every other module (each owns parameters), fp32 islands included, hands bf16 on.
  modules = {
    "/".join(k.key for k in path[:depth])
    for path, _ in jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    for depth in range(1, len(path))
  }
  assert found == {f"{m}/__call__": BF16 for m in modules - {"Dense_0"}}
  assert {"LayerNorm_0", "Embed_0", "LinenBlock_0/LayerNorm_1"} <= modules


class Log:
  """A mutable record (linen would turn a list attribute into a tuple)."""

  def __init__(self):
    self.entries = []

  def append(self, entry):
    self.entries.append(entry)


class Recorder(nn.Module):
  """Records the dtypes its input and its parameter arrive in."""

  log: Log

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones, (x.shape[-1],))
    self.log.append(("Recorder", x.dtype, w.dtype))
    return x * w


class RecordingNorm(nn.LayerNorm):
  log: Log = None

  @nn.compact
  def __call__(self, x, *args, **kwargs):
    y = super().__call__(x, *args, **kwargs)
    scale = self.get_variable("params", "scale")
    self.log.append(("RecordingNorm", x.dtype, scale.dtype))
    return y


class Probed(nn.Module):
  log: Log

  @nn.compact
  def __call__(self, x):
    return RecordingNorm(log=self.log)(Recorder(self.log)(nn.Dense(4)(x)))


def test_inputs_and_parameters_arrive_in_the_module_compute_dtype():
  log = Log()
  model, x = Probed(log), jnp.ones((2, 3))
  variables = _shapes(model.init, jax.random.key(0), x)
  assert {p.dtype for p in jax.tree.leaves(variables)} == {F32}

  def run(**options):
    log.entries.clear()
    _shapes(jlf.policy_apply(model, jlf.ModulePolicies(POLICY, **options)), variables, x)
    # The model's Python runs twice per trace: once abstractly to find which
    # module owns which parameter (with the stored params), then for real.
    return set(log.entries[len(log.entries) // 2 :])

  # Default module: bf16 in, bf16 params. LayerNorm subclass: fp32 (MRO match).
  assert run() == {("Recorder", BF16, BF16), ("RecordingNorm", F32, F32)}
  assert run(overrides={Recorder: "f16", RecordingNorm: None}) == {
    ("Recorder", F16, F16),
    ("RecordingNorm", BF16, BF16),
  }
  # Overriding the enclosing class: everything inside follows it.
  assert run(overrides={Probed: "f16"}) == {("Recorder", F16, F16), ("RecordingNorm", F32, F32)}
  assert run(overrides={Probed: "f32"}) == {("Recorder", F32, F32), ("RecordingNorm", F32, F32)}


def test_gradients_in_param_dtype_and_close_to_fp32(lm):
  model, toks, variables = lm
  bf16 = jlf.policy_apply(model, POLICY)
  f16 = jlf.policy_apply(model, "p=f32,c=f16,o=f32")

  @jit
  def run(params):
    grads = [
      jax.grad(lambda p, apply=apply: lm_loss(apply({"params": p}, toks), toks))(params)
      for apply in (model.apply, bf16)
    ]
    logits = [apply({"params": params}, toks) for apply in (model.apply, bf16, f16)]
    return grads, logits

  (ref_grads, grads), (ref_logits, *logits) = run(variables["params"])
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  assert rel_error(grads, ref_grads) < 0.05  # bf16: 8 significant bits
  for out, tol in zip(logits, (0.03, 0.005), strict=True):
    assert out.dtype == F32 and rel_error(out, ref_logits) < tol


def test_recomputed_islands_exchange_only_16_bit_activations(lm):
  # A recomputed fp32 LayerNorm casts its input and its output inside the checkpoint, so that
  # neither the input nor the output's cotangent crosses it in fp32: XLA keeps what crosses a
  # checkpoint for the backward pass.
  model, toks, variables = lm
  apply = jlf.policy_apply(model, POLICY)
  grad = jax.grad(lambda p: lm_loss(apply({"params": p}, toks), toks))
  assert island_activation_dtypes(jax.make_jaxpr(grad)(variables["params"])) == {BF16}


def test_overrides_are_honoured(lm):
  model, toks, variables = lm
  loss = lambda apply: jax.make_jaxpr(
    jax.grad(lambda p: lm_loss(apply({"params": p}, toks), toks))
  )(variables["params"])
  all_fp32 = {nn.Dense: "f32", nn.DenseGeneral: "f32", nn.MultiHeadDotProductAttention: "f32"}
  jaxpr = loss(jlf.policy_apply(model, jlf.ModulePolicies(POLICY, all_fp32)))
  assert check_lean_products(jaxpr) == 0 and products(jaxpr)
  assert all(in_dtypes(e) == (F32, F32) for e in products(jaxpr))
  # LayerNorm's default removed: no fp32 islands, so none recomputed (Flax's LayerNorm
  # reduces in fp32 either way). With the default, the three LayerNorms are.
  remats = lambda apply: sum(
    e.primitive.name in ("remat2", "checkpoint")
    for e in eqns(jax.make_jaxpr(lambda p: apply({"params": p}, toks))(variables["params"]))
  )
  assert remats(jlf.policy_apply(model, POLICY)) == 3
  assert remats(jlf.policy_apply(model, jlf.ModulePolicies(POLICY, {nn.LayerNorm: None}))) == 0
  # A user attribute beats jmp_lite's kernel: Flax's attention, bf16 softmax (with the op
  # table off; with it on, the op table computes Flax's softmax in fp32).
  flax_attention = {nn.MultiHeadDotProductAttention: jlf.ModuleOverride(
    attributes={"attention_fn": nn.dot_product_attention}
  )}  # fmt: skip
  jaxpr = loss(jlf.policy_apply(model, jlf.ModulePolicies(POLICY, flax_attention, op_table=False)))
  assert BF16 in primitive_dtypes(jaxpr, "exp")
  jaxpr = loss(jlf.policy_apply(model, jlf.ModulePolicies(POLICY, flax_attention)))
  assert primitive_dtypes(jaxpr, "exp") == {F32}
  # Kernels switched off: Flax's bf16 matmuls and softmax come back.
  off = {"fp32_accumulation": False, "fp32_softmax": False, "op_table": False}
  jaxpr = loss(jlf.policy_apply(model, jlf.ModulePolicies(POLICY, **off)))
  assert BF16 in primitive_dtypes(jaxpr, "dot_general") and BF16 in primitive_dtypes(jaxpr, "exp")
  # An output dtype override.
  apply = jlf.policy_apply(
    model, jlf.ModulePolicies(POLICY, {nn.Dense: jlf.ModuleOverride(output_dtype="f32")})
  )
  _, state = _shapes(
    lambda v: apply(v, toks, capture_intermediates=True, mutable=["intermediates"]), variables
  )
  (dense_out,) = state["intermediates"]["LinenBlock_0"]["Dense_0"]["__call__"]
  assert dense_out.dtype == F32


# Options away from their defaults, each changing the LM's program (explicit_dtypes, which
# changes it only for modules built with a dtype=, is tested with such a model below).
OPTIONS = {
  "overrides": {nn.DenseGeneral: "f32"},
  "use_default_overrides": False,
  "fp32_softmax": False,
  "grad_reduction_dtype": F32,
}


def test_every_option_of_a_module_policies_reaches_the_model(lm):
  model, toks, variables = lm
  step = lambda apply: jax.value_and_grad(lambda p: lm_loss(apply({"params": p}, toks), toks))
  program = lambda policy: str(
    jax.make_jaxpr(step(jlf.policy_apply(model, policy)))(variables["params"])
  )
  default = program(POLICY)
  assert program(jlf.ModulePolicies(POLICY)) == default
  for name, value in OPTIONS.items():
    assert program(jlf.ModulePolicies(POLICY, **{name: value})) != default, name
  policies = jlf.ModulePolicies(POLICY, **OPTIONS)
  apply = jlf.policy_apply(model, policies)
  assert apply.policy == jl.get_policy(POLICY)
  # The options change how the model runs, not what it computes: close to fp32.
  loss, grads = jit(step(apply))(variables["params"])
  ref_loss, ref_grads = jit(step(model.apply))(variables["params"])
  assert rel_error(loss, ref_loss) < 0.02
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  assert rel_error(grads, ref_grads) < 0.05  # bf16: 8 significant bits


def _dtypes_in(jaxpr) -> set:
  found = set()
  for eqn in eqns(jaxpr):
    found |= {
      np.dtype(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "dtype")
    }
  return found


def test_no_policy_state_leaks_between_calls(lm):
  model, toks, variables = lm
  before = model.clone()
  conv, x = LinenConvNet(), images()
  conv_vars = _shapes(lambda k: conv.init(k, x, train=False), jax.random.key(1))
  jax.make_jaxpr(lambda v: jlf.policy_apply(model, POLICY)(v, toks))(variables)
  # The next model, applied plainly, sees no trace of the policy.
  plain = jax.make_jaxpr(lambda v: conv.apply(v, x, train=False))(conv_vars)
  assert _dtypes_in(plain.jaxpr) <= {F32, np.dtype(np.int32), np.dtype(bool)}
  # A second policy on the first model: fp16 only, nothing of the bf16 one.
  f16 = jax.make_jaxpr(lambda v: jlf.policy_apply(model, "p=f32,c=f16,o=f32")(v, toks))(variables)
  assert any(in_dtypes(e) == (F16, F16) for e in products(f16))
  assert BF16 not in _dtypes_in(f16.jaxpr)
  # A failing call cleans up too.
  with pytest.raises(AttributeError):  # raised inside the model, mid-apply
    jlf.policy_apply(model, POLICY)(variables, "not tokens")
  plain = jax.make_jaxpr(lambda v: model.apply(v, toks))(variables)
  assert BF16 not in _dtypes_in(plain.jaxpr)
  # The user's module is untouched (attention_fn etc. restored).
  assert model == before


def test_convnet_batchnorm_statistics_fp32_and_updated():
  model, x = LinenConvNet(), images()
  variables = jit(model.init)(jax.random.key(0), x)
  apply = jlf.policy_apply(model, POLICY)

  def loss(params, stats, apply):
    logits, new = apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    return jnp.mean(logits**2), new["batch_stats"]

  @jit
  def run(v):
    return [
      jax.grad(loss, has_aux=True)(v["params"], v["batch_stats"], a) for a in (apply, model.apply)
    ]

  (grads, stats), (ref_grads, ref_stats) = run(variables)
  assert {x.dtype for x in jax.tree.leaves((grads, stats))} == {F32}
  assert rel_error(stats, ref_stats) < 0.01 and rel_error(grads, ref_grads) < 0.05
  assert not np.allclose(
    stats["BatchNorm_0"]["mean"], variables["batch_stats"]["BatchNorm_0"]["mean"]
  )
  jaxpr = jax.make_jaxpr(jax.grad(functools.partial(loss, apply=apply), has_aux=True))(
    variables["params"], variables["batch_stats"]
  )
  # 2 convs forward, 3 backward (the first one's input needs no gradient); the head's 3.
  assert check_lean_products(jaxpr, wide=1) == 2 + 3 + 3
  assert primitive_dtypes(jaxpr, "rsqrt") == {F32}
  assert any(e.primitive.name == "conv_general_dilated" and in_dtypes(e) == (BF16, BF16)
             for e in products(jaxpr))  # fmt: skip


class ScannedLM(nn.Module):
  @nn.compact
  def __call__(self, toks):
    x = nn.Embed(32, 16)(toks)
    blocks = nn.scan(
      nn.remat(_ScanBlock),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=2,
      in_axes=nn.broadcast,
    )
    x, _ = blocks(name="blocks")(x, nn.make_causal_mask(toks))
    return nn.Dense(32)(x)


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    return LinenBlock()(x, mask), None


def test_works_under_jit_grad_vmap_scan_and_lifted_transforms(lm):
  model, toks, variables = lm
  apply = jlf.policy_apply(model, POLICY)
  loss = lambda p, t: lm_loss(apply({"params": p}, t[None]), t[None])

  @jit
  def run(params):
    batched = apply({"params": params}, toks)
    per_example = jax.vmap(lambda t: apply({"params": params}, t[None])[0])(toks)

    def step(total, t):
      value = loss(params, t)
      return total + value, value

    _, losses = jax.lax.scan(step, 0.0, toks)
    return batched, per_example, losses

  batched, per_example, losses = run(variables["params"])
  np.testing.assert_allclose(per_example, batched, atol=1e-6)
  expected = [lm_loss(batched[i : i + 1], toks[i : i + 1]) for i in range(len(toks))]
  np.testing.assert_allclose(losses, expected, rtol=1e-5)

  # Gradient accumulation over micro-batches with lax.scan: fp32 gradients,
  # bf16 products accumulating in fp32.
  def accumulate(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    step = lambda acc, t: (jax.tree.map(jnp.add, acc, jax.grad(loss)(params, t)), None)
    return jax.lax.scan(step, zeros, toks)[0]

  grads = jax.eval_shape(accumulate, variables["params"])
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
  # The head and the softmax backward's row sums have fp32 results (see above); the scan's
  # body, one step's products, is counted once.
  assert check_lean_products(jax.make_jaxpr(accumulate)(variables["params"]), wide=2) == 28

  # Through nn.scan + nn.remat inside the model: the stacked LayerNorm
  # parameters are read in fp32, the stacked kernels in bf16.
  scanned = ScannedLM()
  scanned_params = _shapes(scanned.init, jax.random.key(2), toks)["params"]
  scanned_apply = jlf.policy_apply(scanned, POLICY)
  lifted = lambda p: jax.grad(lambda p: jnp.mean(scanned_apply({"params": p}, toks) ** 2))(p)
  assert {g.dtype for g in jax.tree.leaves(_shapes(lifted, scanned_params))} == {F32}
  jaxpr = jax.make_jaxpr(lifted)(scanned_params)
  # The block's 8 forward products (scan bodies count once) and the head's; in the backward
  # scan the remat recomputes 7 of them (not the last: its output only joins the residual),
  # then the block's 17 backward products; the head's 2.
  assert check_lean_products(jaxpr, wide=2) == 8 + 1 + 7 + 17 + 2
  assert primitive_dtypes(jaxpr, "rsqrt") == {F32}
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(scanned_params)]
  invar_path = dict(zip(jaxpr.jaxpr.invars, paths, strict=True))
  cast = {
    invar_path[v]: np.dtype(e.params["new_dtype"])
    for e in jaxpr.jaxpr.eqns
    if e.primitive.name == "convert_element_type"
    for v in e.invars
    if v in invar_path
  }
  kernels = [p for p in paths if "kernel" in p]
  norms = [p for p in paths if "LayerNorm" in p]
  assert kernels and all(cast.get(p) == BF16 for p in kernels)
  assert norms and not any(p in cast for p in norms)  # read as stored: fp32


class WithMethods(nn.Module):
  def setup(self):
    self.embed = nn.Embed(8, 4)
    self.dense = nn.Dense(4)

  def __call__(self, toks):
    return self.dense(self.embed(toks))

  def decode(self, x):
    return self.embed.attend(self.dense(x))

  @nn.compact
  def grow(self, x):
    return x + self.param("extra", nn.initializers.ones, x.shape[-1:])


def test_methods_mutable_params_and_init():
  model, toks = WithMethods(), jnp.arange(6).reshape(2, 3)
  init = jlf.policy_init(model, POLICY)
  variables = _shapes(init, jax.random.key(0), toks)
  assert {p.dtype for p in jax.tree.leaves(variables)} == {F32}
  half = _shapes(jlf.policy_init(model, "p=bf16,c=bf16,o=bf16"), jax.random.key(0), toks)
  assert {p.dtype for p in jax.tree.leaves(half)} == {BF16}
  apply = jlf.policy_apply(model, POLICY)
  out = _shapes(lambda v: apply(v, jnp.ones((2, 4)), method="decode"), variables)
  assert out.dtype == F32 and out.shape == (2, 8)
  # A parameter created during apply comes back in the param dtype; the others unchanged.
  grow = lambda v: apply(
    v,
    jnp.ones((2, 4)),
    method=WithMethods.grow,
    mutable=["params"],
    rngs={"params": jax.random.key(1)},
  )
  out, new = _shapes(grow, variables)
  assert out.dtype == F32 and new["params"]["extra"].dtype == F32
  assert {p.dtype for p in jax.tree.leaves(new)} == {F32}
  # Existing parameters come back as given (not via a bf16 round trip).
  concrete = jax.tree.map(lambda s: np.full(s.shape, 0.1, s.dtype), variables)
  _, new = grow(concrete)
  assert new["params"]["dense"]["kernel"] is concrete["params"]["dense"]["kernel"]


class SharedHead(nn.Module):
  """One Dense called twice: inside the model, and again as its head."""

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(x.shape[-1], name="shared")
    return shared(nn.Dense(x.shape[-1])(nn.gelu(shared(x))))


def test_only_the_call_computing_the_output_returns_the_output_dtype():
  model, x = SharedHead(), jax.random.normal(jax.random.key(1), (2, 4))
  variables = jit(model.init)(jax.random.key(0), x)
  apply = jlf.policy_apply(model, POLICY)
  capture = lambda m, method: m.name == "shared"
  run = jit(lambda v: apply(v, x, capture_intermediates=capture, mutable=["intermediates"]))
  out, state = run(variables)
  inner, head = state["intermediates"]["shared"]["__call__"]
  # The inner call hands bf16 to the next layer, the head call returns the fp32 output.
  assert (inner.dtype, head.dtype, out.dtype) == (BF16, F32, F32)
  np.testing.assert_array_equal(head, out)
  # Three bf16 matmuls; only the head call's produces fp32, straight from the matmul.
  assert check_lean_products(jax.make_jaxpr(apply)(variables, x), wide=1) == 3
  assert rel_error(out, jit(model.apply)(variables, x)) < 0.02


def test_a_discovery_is_reused_for_arguments_of_the_same_types():
  # Finding the output layers traces the model once more; a call whose arguments have the
  # types and static values of an earlier one reuses what that trace found, and a call with
  # another flag or shape discovers again (here the flag swaps which head is the output).
  traces: list = []

  class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x, first: bool):
      traces.append(first)
      h = nn.Dense(8, name="body")(x)
      a, b = nn.Dense(3, name="a")(h), nn.Dense(3, name="b")(h)
      return a if first else b

  model, x = TwoHeads(), jax.random.normal(jax.random.key(1), (2, 4))
  variables = model.init(jax.random.key(0), x, True)
  apply = jlf.policy_apply(model, POLICY)
  heads = lambda m, method: m.name in ("a", "b")
  for flag, new_traces in ((True, 2), (True, 1), (False, 2), (True, 1), (False, 1)):
    traces.clear()
    out, state = apply(variables, x, flag, capture_intermediates=heads, mutable=["intermediates"])
    assert len(traces) == new_traces, flag
    # The output head returns fp32 straight from its matmul, the other one bf16.
    (a,), (b,) = (state["intermediates"][n]["__call__"] for n in ("a", "b"))
    assert (a.dtype, b.dtype) == ((F32, BF16) if flag else (BF16, F32)), flag
    assert rel_error(out, model.apply(variables, x, flag)) < 0.02
  traces.clear()
  apply(variables, x[:1], True)  # another shape
  assert len(traces) == 2


def test_partitioned_params_keep_their_metadata():
  model = nn.Dense(4, kernel_init=nn.with_partitioning(nn.initializers.ones, (None, "model")))
  x = jnp.ones((2, 3))
  variables = _shapes(model.init, jax.random.key(0), x)
  assert isinstance(variables["params"]["kernel"], nn.Partitioned)
  jaxpr = jax.make_jaxpr(lambda v: jlf.policy_apply(model, POLICY)(v, x))(variables)
  assert check_lean_products(jaxpr, wide=1) == 1  # the model's output: fp32 from the matmul


class ExamplesBlock(nn.Module):
  """Written as in Flax's examples: a dtype attribute handed to every layer."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
    return x + nn.Dense(4, dtype=self.dtype)(nn.relu(h))


class ExamplesModel(nn.Module):
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, dtype=self.dtype, name="head")(ExamplesBlock(self.dtype, name="block")(x))


# Every module whose dtype differs from the policy's; not the LayerNorm (fp32 either way).
EXPLICIT = ("(the model) (ExamplesModel", "block (ExamplesBlock", "block/Dense_0 (Dense",
            "block/Dense_1 (Dense", "head (Dense")  # fmt: skip


def test_explicit_module_dtypes_are_kept_and_named_once_per_trace():
  model, x = ExamplesModel(), jnp.ones((2, 4))
  variables = jit(model.init)(jax.random.key(0), x)
  kept, wins = (
    jlf.policy_apply(model, jlf.ModulePolicies(POLICY, explicit_dtypes=m))
    for m in ("warn", "policy")
  )
  step = jit(lambda v, x: (kept(v, x), wins(v, x), model.apply(v, x)))
  # Inside jit, once per trace: two calls of the compiled step, one warning.
  messages = explicit_dtype_warnings(lambda: [step(variables, x) for _ in range(2)])
  assert len(messages) == 1, messages
  assert all(name in messages[0] for name in EXPLICIT), messages[0]
  assert "LayerNorm" not in messages[0] and messages[0].startswith("policy_apply: 5 module(s)")
  assert "explicit_dtypes='policy'" in messages[0] and "drop dtype=" in messages[0]
  assert len(explicit_dtype_warnings(step.trace, variables, jnp.ones((3, 4)))) == 1  # retrace
  # Kept: the model computes as Flax does, every Dense on fp32 operands, its
  # kernel read unrounded (not cast to bf16 and promoted back by Flax's Dense).
  out, out_wins, ref = step(variables, x)
  np.testing.assert_allclose(out, ref, rtol=1e-6)
  keep = jlf.ModulePolicies(POLICY, explicit_dtypes="keep")
  jaxpr = jax.make_jaxpr(lambda v: jlf.policy_apply(model, keep)(v, x))
  assert not explicit_dtype_warnings(jaxpr, variables)  # "keep" is silent
  assert [in_dtypes(e) for e in products(jaxpr(variables))] == [(F32, F32)] * 3
  assert BF16 not in primitive_dtypes(jaxpr(variables), "convert_element_type")
  # "policy": the policy sets the dtypes, silently: bf16 (the head's output fp32).
  assert not explicit_dtype_warnings(jax.make_jaxpr(wins), variables, x)
  assert check_lean_products(jax.make_jaxpr(wins)(variables, x), wide=1) == 3
  assert 0 < rel_error(out_wins, ref) < 0.05
  # policy_init names them too; the model without dtypes warns about nothing.
  init = jlf.policy_init(model, POLICY)
  messages = explicit_dtype_warnings(jax.eval_shape, init, jax.random.key(0), x)
  assert len(messages) == 1 and messages[0].startswith("policy_init: 5 module(s)")
  plain = jlf.policy_apply(ExamplesModel(dtype=None), POLICY)
  assert not explicit_dtype_warnings(jax.make_jaxpr(plain), variables, x)
  assert check_lean_products(jax.make_jaxpr(plain)(variables, x), wide=1) == 3


def test_policy_init_and_apply_take_every_option_from_a_module_policies():
  model, x, key = ExamplesModel(), jnp.ones((2, 4)), jax.random.key(0)
  keep = jlf.ModulePolicies(POLICY, explicit_dtypes="keep")
  # The object's explicit_dtypes reaches init: silent where the policy string warns,
  # and the parameters Flax's init creates.
  assert len(explicit_dtype_warnings(jax.eval_shape, jlf.policy_init(model, POLICY), key, x)) == 1
  assert not explicit_dtype_warnings(jax.eval_shape, jlf.policy_init(model, keep), key, x)
  variables = jlf.policy_init(model, keep)(key, x)
  ref = model.init(key, x)
  assert jax.tree.structure(variables) == jax.tree.structure(ref)
  jax.tree.map(np.testing.assert_array_equal, variables, ref)
  half = jlf.policy_init(model, jlf.ModulePolicies("p=bf16,c=bf16,o=bf16", explicit_dtypes="keep"))
  assert {p.dtype for p in jax.tree.leaves(half(key, x))} == {BF16}
  # ... and apply: "policy" gives the layers the policy's dtype, as if built without dtype=.
  wins = jlf.ModulePolicies(POLICY, explicit_dtypes="policy")
  program = lambda apply: jax.make_jaxpr(apply)(variables, x)
  assert not explicit_dtype_warnings(program, jlf.policy_apply(model, wins))
  assert check_lean_products(program(jlf.policy_apply(model, wins)), wide=1) == 3  # bf16 products
  np.testing.assert_array_equal(
    jlf.policy_apply(model, wins)(variables, x),
    jlf.policy_apply(ExamplesModel(dtype=None), POLICY)(variables, x),
  )


@pytest.mark.parametrize(
  "make, error, match",
  [
    (lambda: jlf.policy_apply(lambda x: x, POLICY), TypeError, "expects a flax.linen Module"),
    (lambda: jlf.policy_apply(nn.Dense(3).bind({}), POLICY), TypeError, "unbound module"),
    (lambda: jlf.policy_apply(nn.Dense(3), "p=f32,c=e5m2"), ValueError, "fp8"),
    (lambda: jlf.ModulePolicies(POLICY, {nn.Dense: "int8"}), TypeError, "not a floating-point"),
    (lambda: jlf.policy_apply(nn.Dense(3), POLICY)([1, 2], jnp.ones(3)), TypeError,
     "variables must be a mapping"),
    (lambda: jlf.policy_init(object(), POLICY), TypeError, "expects a flax.linen Module"),
    (lambda: jlf.ModulePolicies(POLICY, explicit_dtypes="ignore"), ValueError,
     "explicit_dtypes must be one of 'warn', 'keep', 'policy'; got 'ignore'"),
    (lambda: jlf.policy_apply(nn.Dense(3), 3), TypeError,
     "policy_apply expects a policy: a jmp_lite.Policy, a policy string or a "),
    (lambda: jlf.policy_init(nn.Dense(3), POLICY, fp32_softmx=False), TypeError,
     r"policy_init\(\) got unexpected keyword argument\(s\) 'fp32_softmx'"),
    (lambda: jlf.policy_apply(nn.Dense(3), POLICY, overrides={}), TypeError,
     r"policy_apply\(\) got unexpected keyword argument\(s\) 'overrides'.* "
     r"jl\.flax\.ModulePolicies\(policy, overrides=\.\.\.\)"),
  ],
)  # fmt: skip
def test_bad_input_is_rejected(make, error, match):
  with pytest.raises(error, match=match):
    make()
