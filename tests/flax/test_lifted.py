"""Flax's lifted transforms inside the model, differentially against plain Flax.

Each model (linen and NNX) scans a rematerialized block over 3 stacked layers
and ends in an ensemble of heads (a vmapped Dense/Linear with stacked
parameters). The same model runs plain in fp32 and through the policy: under
an fp32 policy the outputs and gradients are Flax's; under bf16 compute each
gradient leaf is within 5% of Flax's fp32 one, and every matmul, also inside
the scan and remat bodies and in the vmapped heads, runs on bf16 operands
with fp32 accumulation (the policy is not dropped at a transform boundary).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite.flax as jlf

from .flax_testing import BF16, F32, check_lean_products, eqns, in_dtypes, jit, products

WIDTH, LAYERS, ENSEMBLE, BATCH, OUT = 8, 3, 2, 3, 5
FP32_POLICY, POLICY = "p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32"


@functools.cache
def _inputs():
  # Compiled: an eager jax.random.normal compiles its sampler at XLA's default optimization level.
  return jit(lambda: jax.random.normal(jax.random.key(1), (ENSEMBLE, BATCH, WIDTH)))()


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(nn.LayerNorm()(x))
    return x + nn.Dense(WIDTH)(nn.gelu(h)), None


def _scanned_blocks():
  """LAYERS rematerialized linen blocks under nn.scan, parameters stacked on axis 0."""
  return nn.scan(
    nn.remat(_LinenBlock),
    variable_axes={"params": 0},
    split_rngs={"params": True},
    length=LAYERS,
  )


class LinenLifted(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    blocks = _scanned_blocks()
    x, _ = blocks(name="blocks")(x)
    heads = nn.vmap(
      nn.Dense,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=0,
      out_axes=0,
    )
    return heads(OUT, name="heads")(x)  # head i reads x[i]


class _NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.down = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxLifted(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.inp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return _NnxBlock(rngs)

    @nnx.split_rngs(splits=ENSEMBLE)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def heads(rngs):
      return nnx.Linear(WIDTH, OUT, rngs=rngs)

    self.blocks, self.heads = blocks(rngs), heads(rngs)

  def __call__(self, x):
    x = self.inp(x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)

    x = body(x, self.blocks)
    return nnx.vmap(lambda head, x: head(x), in_axes=(0, 0))(self.heads, x)


def _check_close(got, want, *, exact: bool):
  """fp32 policy: Flax's values up to fp32 rounding; bf16: each leaf within 5%."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    assert g.dtype == F32 and g.shape == w.shape, path
    g, w = np.asarray(g), np.asarray(w)  # compared on the host: no eager op to compile
    if exact:
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    else:
      error = float(np.linalg.norm(g - w) / np.linalg.norm(w))
      assert error <= 0.05, (jax.tree_util.keystr(path), error)


def _check_bf16_everywhere(jaxpr):
  """Every matmul runs in bf16 with fp32 accumulation, also inside the lifted transforms."""
  found = products(jaxpr)
  assert found and check_lean_products(jaxpr) == len(found)
  kinds = {"scan": "scan", "remat2": "remat", "checkpoint": "remat"}  # JAX's primitive names
  bodies = {"scan": 0, "remat": 0}
  for eqn in eqns(jaxpr):
    if eqn.primitive.name in kinds:
      inner = products(eqn.params["jaxpr"])
      assert all(in_dtypes(e) == (BF16, BF16) for e in inner), eqn.primitive.name
      bodies[kinds[eqn.primitive.name]] += len(inner)
  # Forward and backward scans: 2 products per block forward (recomputed in the
  # backward scan) and 3 or 4 backward (the gradient of the first layer's
  # input, the data, is not computed); remat bodies hold the recomputed forward.
  assert bodies["scan"] >= 2 + 5 and bodies["remat"] >= 2, bodies
  # The vmapped heads: products whose kernel operand carries the ensemble axis.
  heads = [
    e for e in found if e.invars[1].aval.shape[0] == ENSEMBLE and OUT in e.invars[1].aval.shape
  ]
  assert heads, "no vmapped head product found"


def _losses_and_grads(losses, params):
  """(loss, grads) of each loss function; all compiled as one program with ``params``."""
  return [jax.value_and_grad(loss)(params) for loss in losses]


def _check_against_flax(ref, f32, b16):
  """Each a (loss, grads) pair: plain Flax, the fp32 policy, the bf16 policy."""
  _check_close(f32, ref, exact=True)
  _check_close(b16[1], ref[1], exact=False)
  assert abs(float(b16[0]) - float(ref[0])) <= 0.05 * abs(float(ref[0]))


def test_linen_policy_init_apply_under_scan_remat_vmap_match_flax():
  model, x = LinenLifted(), _inputs()
  applies = (model.apply, jlf.policy_apply(model, FP32_POLICY), jlf.policy_apply(model, POLICY))
  losses = [lambda p, a=a: jnp.mean(a({"params": p}, x) ** 2) for a in applies]

  @jit
  def run(key):
    want, got = model.init(key, x), jlf.policy_init(model, POLICY)(key, x)
    return want, got, _losses_and_grads(losses, want["params"])

  want, got, results = run(jax.random.key(0))
  # Same tree, shapes and values: the rng stream is Flax's, and no parameter is a
  # leaked tracer of a recomputed (jax.checkpoint) LayerNorm.
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, w)
  assert want["params"]["blocks"]["Dense_0"]["kernel"].shape == (LAYERS, WIDTH, WIDTH)
  assert want["params"]["heads"]["kernel"].shape == (ENSEMBLE, WIDTH, OUT)
  _check_against_flax(*results)
  _check_bf16_everywhere(jax.make_jaxpr(jax.grad(losses[2]))(want["params"]))


def _param_fn(model, fn):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return lambda p: fn(nnx.merge(graphdef, p, rest, copy=True)), params


def _nnx_losses(model, x):
  """The loss of plain NNX, the fp32 policy and the bf16 policy, as functions of the Params."""
  views = (
    lambda m: m,
    lambda m: jlf.policy_view(m, FP32_POLICY),
    lambda m: jlf.policy_view(m, POLICY),
  )
  pairs = [_param_fn(model, lambda m, v=v: jnp.mean(v(m)(x) ** 2)) for v in views]
  return [loss for loss, _ in pairs], pairs[0][1]


def test_nnx_policy_view_under_scan_remat_vmap_matches_flax():
  x = _inputs()

  @jit
  def run():  # initializers and all three passes compiled as one program
    losses, params = _nnx_losses(NnxLifted(nnx.Rngs(0)), x)
    return params, _losses_and_grads(losses, params)

  params, results = run()
  assert params["blocks"]["up"]["kernel"].shape == (LAYERS, WIDTH, WIDTH)
  assert params["heads"]["kernel"].shape == (ENSEMBLE, WIDTH, OUT)
  _check_against_flax(*results)
  losses, abstract = _nnx_losses(nnx.eval_shape(lambda: NnxLifted(nnx.Rngs(0))), x)
  _check_bf16_everywhere(jax.make_jaxpr(jax.grad(losses[2]))(abstract))


# Tied embeddings: the head is the embedding's attend (Gemma, T5, GPT-2). The
# lookup feeds the blocks in the compute dtype (under nn.scan, the carry's dtype),
# and only the attend call returns the policy's fp32 output.

VOCAB, LENGTH = 16, 6


@functools.cache
def _tokens():
  return jit(lambda: jax.random.randint(jax.random.key(2), (BATCH, LENGTH), 0, VOCAB))()


def _lm_loss(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


class LinenTiedLM(nn.Module):
  scanned: bool

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, WIDTH, name="embed")
    x = embed(tokens)
    if self.scanned:
      blocks = _scanned_blocks()
      x, _ = blocks(name="blocks")(x)
    else:
      x, _ = _LinenBlock(name="block")(x)
    return embed.attend(nn.LayerNorm()(x))


def _check_logits(logits, ref):
  """Within bf16 noise of plain fp32 Flax: 2% of the largest logit (measured: 0.4-1.3%)."""
  logits, ref = np.asarray(logits), np.asarray(ref)
  error = float(np.max(np.abs(logits - ref)) / np.max(np.abs(ref)))
  assert error <= 0.02, error


def _embed_calls(module, method):
  return isinstance(module, nn.Embed)


@pytest.mark.parametrize("scanned", [True, False], ids=["scan", "unscanned"])
def test_linen_tied_embedding_lookup_in_compute_dtype_and_logits_fp32(scanned):
  model, toks = LinenTiedLM(scanned), _tokens()
  applies = (model.apply, jlf.policy_apply(model, FP32_POLICY), jlf.policy_apply(model, POLICY))
  losses = [lambda p, a=a: _lm_loss(a({"params": p}, toks), toks) for a in applies]

  @jit
  def run(key):
    params = model.init(key, toks)["params"]
    logits, captured = applies[2](
      {"params": params}, toks, capture_intermediates=_embed_calls, mutable=["intermediates"]
    )
    return (
      (params, jlf.policy_init(model, POLICY)(key, toks)["params"]),
      logits,
      captured["intermediates"],
      model.apply({"params": params}, toks),
      [jax.value_and_grad(loss)(params) for loss in losses],
    )

  (want, got), logits, captured, ref_logits, results = run(jax.random.key(0))
  jax.tree.map(np.testing.assert_array_equal, got, want)  # policy_init: Flax's parameters
  (lookup,), (head,) = captured["embed"]["__call__"], captured["embed"]["attend"]
  assert lookup.dtype == BF16 and lookup.shape == (BATCH, LENGTH, WIDTH)
  np.testing.assert_array_equal(head, logits)  # the attend call returned the logits
  assert logits.dtype == F32 and logits.shape == (BATCH, LENGTH, VOCAB)
  _check_logits(logits, ref_logits)
  _check_against_flax(*results)


class NnxTiedLM(nnx.Module):
  def __init__(self, scanned: bool, rngs: nnx.Rngs):
    self.scanned = scanned
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    if scanned:

      @nnx.split_rngs(splits=LAYERS)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def blocks(rngs):
        return _NnxBlock(rngs)

      self.blocks = blocks(rngs)
    else:
      self.blocks = _NnxBlock(rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    self.sow(nnx.Intermediate, "lookup", x)  # what the embedding handed the blocks
    if self.scanned:

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def body(x, block):
        return block(x)

      x = body(x, self.blocks)
    else:
      x = self.blocks(x)
    return self.embed.attend(self.norm(x))


def _captured(model, toks):
  """``model(toks)`` and what it sowed (the embedding's lookup); sow warns outside capture."""
  return nnx.capture(model, nnx.Intermediate)(toks)


@pytest.mark.parametrize("scanned", [True, False], ids=["scan", "unscanned"])
def test_nnx_tied_embedding_lookup_in_compute_dtype_and_logits_fp32(scanned):
  toks = _tokens()
  views = (
    lambda m: m,
    lambda m: jlf.policy_view(m, FP32_POLICY),
    lambda m: jlf.policy_view(m, POLICY),
  )

  @jit
  def run():
    model = NnxTiedLM(scanned, nnx.Rngs(0))
    pairs = [
      _param_fn(model, lambda m, v=v: _lm_loss(_captured(v(m), toks)[0], toks)) for v in views
    ]
    params = pairs[0][1]
    losses = _losses_and_grads([loss for loss, _ in pairs], params)
    return _captured(views[2](model), toks), _captured(model, toks)[0], losses

  (logits, captured), ref_logits, results = run()
  (lookup,) = captured["module"]["lookup"].get_value()  # sown by the view's copy of the model
  assert lookup.dtype == BF16 and lookup.shape == (BATCH, LENGTH, WIDTH)
  assert logits.dtype == F32 and logits.shape == (BATCH, LENGTH, VOCAB)
  _check_logits(logits, ref_logits)
  _check_against_flax(*results)
