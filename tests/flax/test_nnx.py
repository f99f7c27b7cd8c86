import functools

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
  NnxBlock,
  NnxConvNet,
  NnxLM,
  check_hlo_products,
  check_lean_products,
  eqns,
  explicit_dtype_warnings,
  images,
  in_dtypes,
  island_activation_dtypes,
  jit,
  lm_loss,
  nnx_model,
  out_dtype,
  primitive_dtypes,
  products,
  rel_error,
  tokens,
)

POLICY = "p=f32,c=bf16,o=f32"


def _param_fn(model, fn):
  """``fn(model)`` as a function of the model's Params (for jax.grad / make_jaxpr).

  The model is rebuilt inside the traced function (copy=True): NNX only lets a
  trace split, merge or update Variables created at its own level.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return lambda p: fn(nnx.merge(graphdef, p, rest, copy=True)), params


def _lm_loss(policy=POLICY, **options):
  """The LM's loss through a view under ``policy``, or ``ModulePolicies(policy, **options)``."""
  toks = tokens()
  policy = jlf.ModulePolicies(policy, **options) if options else policy
  return lambda m: lm_loss(jlf.policy_view(m, policy)(toks), toks)


def test_transformer_matmuls_are_16_bit_and_islands_are_fp32():
  loss, params = _param_fn(nnx_model(NnxLM), _lm_loss())
  traced = jax.jit(jax.grad(loss)).trace(params)  # one trace: its jaxpr and its HLO
  jaxpr = traced.jaxpr
  # 9 forward, 17 backward products, and the softmax backward's row sums <dp, p>; two
  # fp32 results: those row sums and the head's (the model's output, fp32 logits).
  assert check_lean_products(jaxpr, wide=2) >= 27
  assert check_hlo_products(traced.lower().as_text(), wide=2) >= 27
  for name in ("exp", "log", "rsqrt", "reduce_max"):
    assert primitive_dtypes(jaxpr, name) == {F32}, name


def test_recomputed_islands_exchange_only_16_bit_activations():
  # As in linen: the casts of a recomputed LayerNorm are inside its checkpoint.
  loss, params = _param_fn(nnx_model(NnxLM), _lm_loss())
  assert island_activation_dtypes(jax.make_jaxpr(jax.grad(loss))(params)) == {BF16}


class Log:
  """A mutable record, kept by NNX as a static attribute."""

  def __init__(self):
    self.entries = []

  def append(self, entry):
    self.entries.append(entry)


class Recorder(nnx.Module):
  """Records the dtypes its input and its parameter arrive in."""

  def __init__(self, log, width):
    self.log = log
    self.w = nnx.Param(jnp.ones((width,)))

  def __call__(self, x):
    self.log.append(("Recorder", x.dtype, self.w.dtype))
    return x * self.w[...]


class RecordingNorm(nnx.LayerNorm):
  def __init__(self, log, width, *, rngs):
    super().__init__(width, rngs=rngs)
    self.log = log

  def __call__(self, x):
    self.log.append(("RecordingNorm", x.dtype, self.scale.dtype))
    return super().__call__(x)


class Probed(nnx.Module):
  def __init__(self, log, *, rngs):
    self.log = log
    self.dense = nnx.Linear(3, 4, rngs=rngs)
    self.items = nnx.List([Recorder(log, 4), RecordingNorm(log, 4, rngs=rngs)])

  def __call__(self, x):
    h = self.dense(x)
    self.log.append(("dense output", h.dtype, None))
    for layer in self.items:
      h = layer(h)
    self.log.append(("norm output", h.dtype, None))
    return h


def test_inputs_parameters_and_outputs_have_their_dtypes():
  log = Log()
  model, x = Probed(log, rngs=nnx.Rngs(0)), jnp.ones((2, 3))

  def run(**options):
    def twice():
      view = jlf.policy_view(model, jlf.ModulePolicies(POLICY, **options))
      view(x)  # the first call also traces the model to find its output layers
      log.entries.clear()
      return view(x)

    out = jax.eval_shape(twice)
    return out.dtype, set(log.entries)

  # Parameters and inputs in the module's compute dtype; islands hand bf16 back,
  # except the norm computing the model's output, which returns the output dtype.
  assert run() == (
    F32,
    {
      ("dense output", BF16, None),
      ("Recorder", BF16, BF16),
      ("RecordingNorm", F32, F32),
      ("norm output", F32, None),
    },
  )
  assert run(overrides={Recorder: "f16", RecordingNorm: None})[1] >= {
    ("Recorder", F16, F16),
    ("RecordingNorm", BF16, BF16),
  }
  # Overriding the enclosing class runs everything inside in its dtype.
  assert run(overrides={Probed: "f32"})[1] == {
    ("dense output", F32, None),
    ("Recorder", F32, F32),
    ("RecordingNorm", F32, F32),
    ("norm output", F32, None),
  }


def test_view_leaves_the_model_alone_and_shares_its_state():
  model, x = nnx_model(NnxConvNet), images()
  kernel = model.conv1.kernel
  view = jlf.policy_view(model, POLICY)
  assert view.conv1.kernel.dtype == BF16 and view.bn.scale.dtype == F32  # read through
  assert model.conv1.kernel is kernel and kernel.dtype == F32
  assert view.bn.mean is model.bn.mean  # batch statistics are shared, not copied

  graphdef, state = nnx.split(model)

  @jit
  def train_forward(state):  # what nnx.jit does, compiled faster for the test
    model = nnx.merge(graphdef, state)
    return jlf.policy_view(model, POLICY)(x), nnx.state(model)

  mean = np.asarray(model.bn.mean[...]).copy()
  out, state = train_forward(state)
  nnx.update(model, state)
  assert out.dtype == F32
  assert model.bn.mean.dtype == F32 and not np.allclose(model.bn.mean[...], mean)
  assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}


def test_gradients_in_param_dtype_and_close_to_fp32():
  model, toks = nnx_model(NnxLM), tokens()
  ref_loss, params = _param_fn(model, lambda m: lm_loss(m(toks), toks))
  loss, _ = _param_fn(model, _lm_loss())
  logits, _ = _param_fn(model, lambda m: (m(toks), jlf.policy_view(m, POLICY)(toks)))

  @jit
  def run(params):
    return jax.grad(ref_loss)(params), jax.grad(loss)(params), logits(params)

  ref_grads, grads, (ref_logits, logits) = run(params)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  assert rel_error(grads, ref_grads) < 0.05 and rel_error(logits, ref_logits) < 0.03
  assert logits.dtype == F32


def test_overrides_are_honoured():
  model = nnx_model(NnxLM)
  jaxpr = lambda **options: jax.make_jaxpr(jax.grad(_param_fn(model, _lm_loss(**options))[0]))(
    nnx.state(model, nnx.Param)
  )
  all_fp32 = {nnx.Linear: "f32", nnx.LinearGeneral: "f32", nnx.MultiHeadAttention: "f32"}
  found = jaxpr(overrides=all_fp32)
  assert check_lean_products(found) == 0 and products(found)
  # The block in fp32; the head (outside it) still bf16.
  loss, params = _param_fn(model, _lm_loss(overrides={NnxBlock: "f32"}))
  forward = products(jax.make_jaxpr(loss)(params))
  half = [e for e in forward if BF16 in in_dtypes(e)]
  assert len(half) == 1 and half[0].outvars[0].aval.shape[-1] == 32  # the vocabulary head
  assert len(forward) == 9 and check_lean_products(jax.make_jaxpr(loss)(params), wide=1) == 1
  # Kernels switched off: Flax's products, the head's output rounded to bf16 too.
  found = jaxpr(fp32_accumulation=False, fp32_softmax=False)
  heads = [e for e in products(found) if e.outvars[0].aval.shape[-1] == 32 and BF16 in in_dtypes(e)]
  assert heads and {out_dtype(e) for e in heads} == {BF16}


# Options away from their defaults, each changing the LM's program, or (explicit_dtypes:
# NNX's Embed has dtype=float32, the policy without the defaults bf16) its warnings.
OPTIONS = {
  "overrides": {nnx.LinearGeneral: "f32"},
  "use_default_overrides": False,
  "fp32_softmax": False,
  "grad_reduction_dtype": F32,
  "explicit_dtypes": "keep",
}


def test_every_option_of_a_module_policies_reaches_the_view():
  model = nnx_model(NnxLM)
  programs = {}  # each traced once, its warnings recorded as it is

  def program(name, policy):
    loss, params = _param_fn(model, _lm_loss(policy))
    programs[name] = str(jax.make_jaxpr(jax.value_and_grad(loss))(params))

  program("string", POLICY)
  program("default", jlf.ModulePolicies(POLICY))
  assert programs["string"] == programs["default"]
  for name, value in OPTIONS.items():
    if name != "explicit_dtypes":
      messages = explicit_dtype_warnings(program, name, jlf.ModulePolicies(POLICY, **{name: value}))
      assert programs[name] != programs["default"], name
      # Without the default overrides, NNX's Embed keeps its dtype=float32: named.
      assert len(messages) == (name == "use_default_overrides"), (name, messages)
  # explicit_dtypes="keep": nothing named.
  assert not explicit_dtype_warnings(program, "all", jlf.ModulePolicies(POLICY, **OPTIONS))
  # All of them: the view computes the loss and gradients close to fp32's.
  policies = jlf.ModulePolicies(POLICY, **OPTIONS)
  by_object, params = _param_fn(model, _lm_loss(policies))
  ref_fn, _ = _param_fn(model, lambda m: lm_loss(m(tokens()), tokens()))
  (loss, grads), (ref_loss, ref_grads) = jit(
    lambda p: [jax.value_and_grad(fn)(p) for fn in (by_object, ref_fn)]
  )(params)
  assert rel_error(loss, ref_loss) < 0.02
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  assert rel_error(grads, ref_grads) < 0.05  # bf16: 8 significant bits
  view = jlf.policy_view(model, jlf.ModulePolicies(POLICY, {nnx.LinearGeneral: F32}))
  assert isinstance(view, jlf.PolicyModule) and view.block.attn.query.kernel.dtype == F32


def test_methods_and_attributes_read_through_the_view():
  model = nnx_model(NnxLM)
  view = jlf.policy_view(model, POLICY)
  assert view.head.kernel.dtype == BF16 and view.block.norm1.scale.dtype == F32
  assert isinstance(view.embed.module, nnx.Embed) and view.embed.num_embeddings == 32
  # A method reached through the view is cast like __call__: Embed is an fp32
  # island, so attend reads fp32 inputs and returns bf16 to its caller.
  out = jax.eval_shape(view.embed.attend, jnp.ones((2, 16), F32))
  assert out.dtype == BF16
  jaxpr = jax.make_jaxpr(view.embed.attend)(jnp.ones((2, 16), BF16))
  assert any(in_dtypes(e) == (F32, F32) for e in products(jaxpr))


class SharedHead(nnx.Module):
  """One Linear called twice: inside the model, and again as its head."""

  def __init__(self, width: int = 4, *, rngs: nnx.Rngs):
    self.shared = nnx.Linear(width, width, rngs=rngs)
    self.mid = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    h = self.shared(x)
    self.sow(nnx.Intermediate, "inner", h)
    return self.shared(self.mid(nnx.gelu(h)))


def test_only_the_call_computing_the_output_returns_the_output_dtype():
  model, x = nnx_model(SharedHead), jax.random.normal(jax.random.key(1), (2, 4))
  forward = lambda m: nnx.capture(m, nnx.Intermediate)(x)
  out, state = jit(lambda: forward(jlf.policy_view(model, POLICY)))()
  (inner,) = state["module"]["inner"].get_value()
  # The inner call hands bf16 to the next layer, the head call returns the fp32 output.
  assert (inner.dtype, out.dtype) == (BF16, F32)
  # Three bf16 matmuls; only the head call's produces fp32, straight from the matmul.
  jaxpr = jax.make_jaxpr(lambda: forward(jlf.policy_view(model, POLICY)))()
  assert check_lean_products(jaxpr, wide=1) == 3
  # Later calls of the view, and calls of a submodule outside a call of the view,
  # return what they return inside the model.
  twice = jax.eval_shape(lambda: [forward(jlf.policy_view(model, POLICY))[0] for _ in "ab"])
  assert [o.dtype for o in twice] == [F32, F32]
  assert jax.eval_shape(jlf.policy_view(model, POLICY).shared, x).dtype == BF16
  graphdef, params = nnx.split(model)  # plain NNX, on a copy made inside the trace
  assert rel_error(out, jit(lambda p: forward(nnx.merge(graphdef, p))[0])(params)) < 0.02


def test_copies_of_a_view_share_the_output_layers_its_first_call_finds():
  # What the view finds on its first call is held by the view itself, in one object its
  # copies share: a copy made before any call (nnx.split/merge, as nnx.jit's inputs are)
  # finds the output layer too, and the original view then uses what the copy found.
  model, x = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((4, 3))
  view = jlf.policy_view(model, POLICY)
  copy = nnx.merge(*nnx.split(view))
  head = lambda fn: [out_dtype(e) for e in products(jax.make_jaxpr(fn)(x))]
  assert head(copy) == [F32]  # fp32 straight from the bf16 matmul
  assert head(view) == [F32]
  np.testing.assert_array_equal(jit(copy)(x), jit(view)(x))
  assert rel_error(jit(view)(x), model(x)) < 0.01


def _dtypes_in(jaxpr) -> set:
  return {np.dtype(v.aval.dtype) for e in eqns(jaxpr) for v in (*e.invars, *e.outvars)}


def test_no_policy_state_leaks_between_calls():
  lm, conv, toks, x = nnx_model(NnxLM), nnx_model(NnxConvNet, 1), tokens(), images()
  jax.make_jaxpr(lambda: jlf.policy_view(lm, POLICY)(toks))()
  plain = jax.make_jaxpr(lambda: (lm(toks), nnx.view(conv, use_running_average=True)(x)))()
  assert _dtypes_in(plain) <= {F32, np.dtype(np.int32), np.dtype(bool), np.dtype(np.uint32)}
  f16 = jax.make_jaxpr(lambda: jlf.policy_view(lm, "p=f32,c=f16,o=f32")(toks))()
  assert BF16 not in _dtypes_in(f16) and any(in_dtypes(e) == (F16, F16) for e in products(f16))
  assert type(lm.block.attn.attention_fn) is type(nnx.dot_product_attention)
  assert lm.block.up.dot_general is jax.lax.dot_general


def test_works_under_jit_grad_vmap_and_scan():
  model, toks = nnx_model(NnxLM), tokens(batch=3)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda view, t: lm_loss(view(t[None]), t[None])

  @jit
  def run(params):
    # Build the view where the model lives; call it inside vmap and scan (NNX
    # does not let an inner trace split a model from an outer one).
    view = jlf.policy_view(nnx.merge(graphdef, params, rest, copy=True), POLICY)
    per_example = jax.vmap(lambda t: view(t[None])[0])(toks)
    _, losses = jax.lax.scan(lambda c, t: (c, loss(view, t)), 0.0, toks)
    return view(toks), per_example, losses

  batched, per_example, losses = run(params)
  np.testing.assert_allclose(per_example, batched, atol=1e-6)
  example_loss = jit(lm_loss)
  expected = [example_loss(batched[i : i + 1], toks[i : i + 1]) for i in range(3)]
  np.testing.assert_allclose(losses, expected, rtol=1e-5)

  def accumulate(params):  # gradient accumulation over micro-batches
    def step(acc, t):
      grad_fn = jax.grad(_param_fn(model, lambda m: loss(jlf.policy_view(m, POLICY), t))[0])
      return jax.tree.map(jnp.add, acc, grad_fn(params)), None

    return jax.lax.scan(step, jax.tree.map(jnp.zeros_like, params), toks)[0]

  jaxpr = jax.make_jaxpr(accumulate)(params)
  assert {np.dtype(a.dtype) for a in jaxpr.out_avals} == {F32}
  assert check_lean_products(jaxpr, wide=2) >= 27


def test_convnet_batchnorm_in_fp32():
  model, x = nnx_model(NnxConvNet), images()
  loss, params = _param_fn(model, lambda m: jnp.mean(jlf.policy_view(m, POLICY)(x) ** 2))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
  assert check_lean_products(jaxpr, wide=1) >= 5
  assert primitive_dtypes(jaxpr, "rsqrt") == {F32}
  assert any(e.primitive.name == "conv_general_dilated" and in_dtypes(e) == (BF16, BF16)
             for e in products(jaxpr))  # fmt: skip


class ExamplesModel(nnx.Module):
  """Written as in Flax's examples: every layer built with the model's dtype."""

  def __init__(self, dtype=jnp.float32, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(4, dtype=dtype, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(4, 8, dtype=dtype, rngs=rngs),
                            nnx.Linear(8, 4, dtype=dtype, rngs=rngs)])  # fmt: skip
    self.head = nnx.Linear(4, 2, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.head(x + self.layers[1](nnx.relu(self.layers[0](self.norm(x)))))


def test_explicit_module_dtypes_are_kept_and_named_once_per_trace():
  model, x = ExamplesModel(rngs=nnx.Rngs(0)), jnp.ones((2, 4))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def outputs(params, x):
    m = nnx.merge(graphdef, params, rest, copy=True)
    wins = jlf.policy_view(m, jlf.ModulePolicies(POLICY, explicit_dtypes="policy"))
    return jlf.policy_view(m, POLICY)(x), wins(x), m(x)

  step = jit(outputs)
  # The view is built inside the step: one warning per trace, not per call.
  messages = explicit_dtype_warnings(lambda: [step(params, x) for _ in range(2)])
  assert len(messages) == 1, messages
  assert messages[0].startswith("policy_view: 3 module(s)"), messages[0]
  for name in ("layers/0 (Linear: dtype=float32, policy: bfloat16)", "layers/1 (Linear",
               "head (Linear", "explicit_dtypes='policy'", "explicit_dtypes='keep'"):  # fmt: skip
    assert name in messages[0], (name, messages[0])
  assert "LayerNorm" not in messages[0]  # fp32 under the policy too
  # Kept: the Linears multiply fp32 operands, their kernels read unrounded (the
  # activations between them are bf16: the model itself has no dtype).
  out, out_wins, ref = step(params, x)
  assert rel_error(out, ref) < 0.01
  view = jlf.policy_view(model, jlf.ModulePolicies(POLICY, explicit_dtypes="keep"))
  assert view.head.kernel.dtype == F32 and view.layers[0].kernel.dtype == F32
  assert [in_dtypes(e) for e in products(jax.make_jaxpr(view)(x))] == [(F32, F32)] * 3
  # "policy": the policy sets the dtypes (on the view only), silently.
  wins = functools.partial(
    jlf.policy_view, model, jlf.ModulePolicies(POLICY, explicit_dtypes="policy")
  )
  assert not explicit_dtype_warnings(wins)
  wins = wins()
  assert check_lean_products(jax.make_jaxpr(wins)(x), wide=1) == 3
  assert wins.head.dtype == BF16 and model.head.dtype == F32
  assert 0 < rel_error(out_wins, ref) < 0.05
  # A model without dtypes warns about nothing.
  plain = ExamplesModel(dtype=None, rngs=nnx.Rngs(0))
  assert not explicit_dtype_warnings(jlf.policy_view, plain, POLICY)


class Pair(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.data((nnx.Linear(2, 2, rngs=rngs), nnx.Linear(2, 2, rngs=rngs)))

  def __call__(self, x):
    return self.layers[1](self.layers[0](x))


@pytest.mark.parametrize(
  "make, error, match",
  [
    (lambda: jlf.policy_view(jax.numpy.ones(3), POLICY), TypeError, "expects a flax.nnx Module"),
    (lambda: jlf.policy_view(object(), POLICY), TypeError, "expects a flax.nnx Module"),
    (lambda: jlf.policy_view(Pair(nnx.Rngs(0)), POLICY), TypeError, "immutable container"),
    (lambda: jlf.policy_view(Pair(nnx.Rngs(0)), "c=e4m3"), ValueError, "fp8"),
    (
      lambda: jlf.ModulePolicies(POLICY, explicit_dtypes=None),
      ValueError,
      "explicit_dtypes must be one of 'warn', 'keep', 'policy'; got None",
    ),
    (
      lambda: jlf.policy_view(Pair(nnx.Rngs(0)), jax.numpy.bfloat16),
      TypeError,
      "policy_view expects a policy: .* got <class 'jax.numpy.bfloat16'>",
    ),
    (
      lambda: jlf.policy_view(Pair(nnx.Rngs(0)), POLICY, overides={}),
      TypeError,
      r"policy_view\(\) got unexpected keyword argument\(s\) 'overides'",
    ),
  ],
)
def test_bad_input_is_rejected(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_the_output_layer_returns_fp32_also_when_first_called_under_a_transform():
  # The view finds its output layer on its first call; here that call is inside
  # jax.vmap, a trace below the one the view was built at.
  graphdef, state = nnx.split(nnx_model(NnxLM))
  toks = tokens(batch=2)

  def run(state, batched):
    view = jlf.policy_view(nnx.merge(graphdef, state), POLICY)
    if batched:
      return jax.vmap(lambda t: view(t[None])[0])(toks)
    return view(toks)

  jaxpr = jax.make_jaxpr(lambda s: run(s, True))(state)
  (head,) = [e for e in products(jaxpr) if out_dtype(e) == F32 and BF16 in in_dtypes(e)]
  assert head.outvars[0].aval.shape[-1] == 32  # the vocabulary head, under vmap
  batched, plain = jit(lambda s: (run(s, True), run(s, False)))(state)
  np.testing.assert_allclose(batched, plain, rtol=1e-5, atol=1e-5)


class Flagged(nnx.Module):
  """A model called with a Python flag and a string, as NNX models often are."""

  def __init__(self, *, rngs):
    self.body = nnx.Linear(3, 4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, train: bool, mode: str = "eval"):
    assert mode in ("eval", "train")
    h = self.body(x)
    return self.head(self.drop(h, deterministic=not train))


@pytest.mark.parametrize("grad_reduction_dtype", [None, F32])
def test_output_layer_discovery_keeps_python_arguments_and_options(grad_reduction_dtype):
  model = Flagged(rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  x = jnp.ones((2, 3))

  def heads(train):
    def run(state, x):
      policies = jlf.ModulePolicies(POLICY, grad_reduction_dtype=grad_reduction_dtype)
      view = jlf.policy_view(nnx.merge(graphdef, state), policies)
      return view(x, train, mode="train" if train else "eval")

    jaxpr = jax.make_jaxpr(run)(state, x)
    return [out_dtype(e) for e in products(jaxpr) if e.outvars[0].aval.shape == (2, 2)]

  # The head returns fp32 straight from its matmul, with grad_reduction_dtype too.
  assert heads(False) == [F32] and heads(True) == [F32]
  with pytest.raises(ValueError, match="grad_reduction_dtype needs jmp_lite's kernels"):
    jlf.ModulePolicies(POLICY, grad_reduction_dtype=F32, fp32_accumulation=False)
