"""Where fp8 runs in Flax models (linen and NNX): filters, first/last layers, the shape rule.

Which layer ran in fp8 is read from the program itself: each Dense's kernel has its own shape,
so the dtype of the ``dot_general`` whose right operand has that shape says whether the layer's
matmul was fp8 (the jaxpr), and delayed scaling's state says which layers hold fp8 state.
"""

import itertools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmp_lite import fp8
from jmp_lite.flax import fp8 as flax_fp8

NO_SHAPE_RULE = fp8.Fp8Placement(shape_rule=None)  # the tests' layers are far below the estimate
F8 = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}
WIDTHS = (3, 4, 5, 6, 2)  # every kernel a different shape


def _jaxprs(value):
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _jaxprs(item)


def kernel_dtypes(jaxpr) -> dict:
  """``{kernel shape: "fp8" | dtype}`` of every dot_general in a jaxpr, sub-jaxprs included."""
  found = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars)
      fp8_dot = np.dtype(lhs.dtype) in F8 and np.dtype(rhs.dtype) in F8
      found[tuple(rhs.shape)] = "fp8" if fp8_dot else np.dtype(rhs.dtype).name
    for value in eqn.params.values():
      for sub in _jaxprs(value):
        found.update(kernel_dtypes(sub))
  return found


def inputs(shape=(8, 3), seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# linen ---------------------------------------------------------------------------------


class Mlp(nn.Module):
  widths: tuple = WIDTHS

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.widths[1:-1]):
      x = jnp.tanh(nn.Dense(width, name=f"hidden_{i}")(x))
    return nn.Dense(self.widths[-1], name="head")(x)


def linen_run(model, x, placement, recipe=None):
  """(variables, the forward jaxpr's kernel dtypes, the placement report) under ``placement``."""
  recipe = fp8.CurrentScaling() if recipe is None else recipe
  with flax_fp8.linen_fp8(recipe, placement=placement):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
  with flax_fp8.placement_report() as report, flax_fp8.linen_fp8(recipe, placement=placement):
    jaxpr = jax.make_jaxpr(model.apply)(variables, x)
  return variables, kernel_dtypes(jaxpr.jaxpr), report


def test_linen_default_keeps_the_first_and_last_layers_in_the_compute_dtype():
  variables, kernels, report = linen_run(Mlp(), inputs(), NO_SHAPE_RULE, fp8.DelayedScaling())
  assert kernels == {(3, 4): "float32", (4, 5): "fp8", (5, 6): "fp8", (6, 2): "float32"}
  assert set(variables[flax_fp8.STATE_COLLECTION]) == {"hidden_1", "hidden_2"}
  assert report.fp8 == ("hidden_1", "hidden_2")
  assert report.kept == {
    "hidden_0": "the first matmul layer (keep_first_last)",
    "head": "the last matmul layer (keep_first_last)",
  }
  assert str(report).splitlines()[1].split() == [
    "hidden_0",
    "no",
    "the",
    "first",
    *"matmul layer (keep_first_last)".split(),
  ]


def test_linen_kept_layers_compute_flax_s_own_matmul_and_the_rest_fp8():
  model, x = Mlp(), inputs()
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]

  @jax.jit
  def reference(params, x):
    dense = lambda name, x: x @ params[name]["kernel"] + params[name]["bias"]
    fp8_dense = lambda name, x: (
      fp8.dot_general(x, params[name]["kernel"], (((1,), (0,)), ((), ()))) + params[name]["bias"]
    )
    h = jnp.tanh(dense("hidden_0", x))
    h = jnp.tanh(fp8_dense("hidden_2", jnp.tanh(fp8_dense("hidden_1", h))))
    return dense("head", h)

  @jax.jit
  def placed(params, x):
    with flax_fp8.linen_fp8(placement=NO_SHAPE_RULE):
      return model.apply({"params": params}, x)

  np.testing.assert_array_equal(placed(params, x), reference(params, x))


def test_linen_turning_the_defaults_off_runs_every_layer_in_fp8():
  _, kernels, report = linen_run(Mlp(), inputs(), fp8.ALL_LAYERS)
  assert set(kernels.values()) == {"fp8"} and len(kernels) == 4
  assert report.kept == {}
  with pytest.warns(flax_fp8.Fp8PlacementWarning, match="hidden_0: M, K, N = 8, 3, 4: too small"):
    _, kernels, _ = linen_run(Mlp(), inputs(), fp8.Fp8Placement(keep_first_last=False))
  assert set(kernels.values()) == {"float32"}  # the shape rule alone: all far too small


class Wide(nn.Module):
  """A first layer, one middle layer of ``d x d`` and a head: only the middle one can be fp8."""

  d: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.d, name="first")(x)
    h = nn.Dense(self.d, name="middle")(h)
    return nn.Dense(2, name="head")(h)


@pytest.mark.parametrize("tokens, expected", [(905, "float32"), (906, "fp8")])
def test_linen_shape_rule_at_its_boundary(tokens, expected):
  # The rule's boundary for K = N = 2048 (traced abstractly: nothing of this size is computed).
  d = 2048
  assert fp8.MatmulRoofline().should_run(tokens, d, d) == (expected == "fp8")
  x = jax.ShapeDtypeStruct((tokens, 3), jnp.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, kernels, report = linen_run(Wide(d), x, fp8.Fp8Placement())
  # Below the boundary no layer runs in fp8, and the user is told.
  assert [type(w.message) for w in caught] == [flax_fp8.Fp8PlacementWarning] * (expected != "fp8")
  assert kernels == {(3, d): "float32", (d, d): expected, (d, 2): "float32"}
  assert report.layers["middle"].shape == (tokens, d, d)
  if expected == "fp8":
    assert report.fp8 == ("middle",)
  else:
    assert report.kept["middle"] == f"M, K, N = {tokens}, {d}, {d}: too small to pay (shape_rule)"


class Mlp2(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="out")(jnp.tanh(nn.Dense(4, name="inp")(x)))


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="proj")(x)


class Tower(nn.Module):
  """Paths ``embed``, ``attention/proj``, ``mlp/inp``, ``mlp/out``, ``head``."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="embed")(x)
    x = Attention(name="attention")(x)
    x = Mlp2(name="mlp")(x)
    return nn.Dense(3, name="head")(jnp.pad(x, ((0, 0), (0, 3))))


@pytest.mark.parametrize(
  "include, exclude, fp8_layers",
  [
    ((), (), {"embed", "attention/proj", "mlp/inp", "mlp/out", "head"}),
    ((), "attention", {"embed", "mlp/inp", "mlp/out", "head"}),
    ((), (Attention,), {"embed", "mlp/inp", "mlp/out", "head"}),  # a class a layer is inside
    ((), (nn.Dense,), set()),  # the layers' own class
    ("^mlp/", (), {"mlp/inp", "mlp/out"}),
    ((Mlp2, "head"), "out$", {"mlp/inp", "head"}),
  ],
)
def test_linen_filters_by_path_and_class(include, exclude, fp8_layers):
  placement = fp8.Fp8Placement(include, exclude, keep_first_last=False, shape_rule=None)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", flax_fp8.Fp8PlacementWarning)  # the empty case warns
    variables, _, report = linen_run(Tower(), inputs((2, 3)), placement, fp8.DelayedScaling())
  state = variables.get(flax_fp8.STATE_COLLECTION, {})
  state_layers = {
    "/".join(p.key for p in path[:-3])  # .../<layer>/fp8_dot/<tensor>/<field>
    for path, _ in jax.tree_util.tree_flatten_with_path(dict(state))[0]
  }
  assert state_layers == fp8_layers
  assert set(report.fp8) == fp8_layers


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.Dense(4, name="down")(jnp.tanh(nn.Dense(7, name="up")(x))), None


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="inp")(x)
    stack = nn.scan(
      Block,
      variable_axes={"params": 0, flax_fp8.STATE_COLLECTION: 0},
      split_rngs={"params": True},
      length=3,
    )
    x, _ = stack(name="blocks")(x, None)
    return nn.Dense(2, name="head")(x)


def test_linen_filter_applies_per_layer_inside_a_scanned_stack():
  placement = fp8.Fp8Placement(exclude="down", shape_rule=None)
  variables, kernels, report = linen_run(Scanned(), inputs(), placement, fp8.DelayedScaling())
  # The scan body's "up" is fp8 in every one of the 3 layers (one stacked state); "down" is not.
  assert kernels == {(3, 4): "float32", (4, 7): "fp8", (7, 4): "float32", (4, 2): "float32"}
  state = variables[flax_fp8.STATE_COLLECTION]
  assert set(state) == {"blocks"} and set(state["blocks"]) == {"up"}
  assert state["blocks"]["up"]["fp8_dot"].input.scale.shape == (3,)
  assert report.kept == {
    "inp": "the first matmul layer (keep_first_last)",
    "blocks/down": "excluded by 'down'",
    "head": "the last matmul layer (keep_first_last)",
  }


def test_linen_placement_composes_with_loss_scaling():
  """The fp8 layers see the loss scale, the kept ones compute plainly: with current scaling a
  power-of-two loss scale changes no gradient bit once unscaled."""
  model, x = Mlp(), inputs()
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]

  @jax.jit
  def grads(params, scale):
    def loss(params):
      with flax_fp8.linen_fp8(loss_scale=scale, placement=NO_SHAPE_RULE):
        return jnp.sum(model.apply({"params": params}, x) ** 2) * scale

    return jax.tree.map(lambda g: g / scale, jax.grad(loss)(params))

  with flax_fp8.placement_report() as report:  # filled by the one trace of grads
    unscaled = grads(params, jnp.float32(1.0))
  scaled = grads(params, jnp.float32(2.0**12))
  jax.tree.map(np.testing.assert_array_equal, scaled, unscaled)
  assert report.fp8 == ("hidden_1", "hidden_2")


def test_linen_pattern_matching_no_layer_is_an_error():
  with pytest.raises(
    ValueError,
    match=r"pattern\(s\) 'mpl', Attention match no matmul layer of Mlp; its layers "
    r".* hidden_0, hidden_1, hidden_2, head",
  ):
    linen_run(Mlp(), inputs(), fp8.Fp8Placement(include="mpl", exclude=(Attention,)))


def test_linen_bad_placement_is_a_type_error():
  with pytest.raises(TypeError, match=r"placement must be an fp8\.Fp8Placement .* got 'all'"):
    flax_fp8.linen_interceptor(placement="all")


def test_linen_no_layer_in_fp8_warns_at_apply_not_at_init():
  model, x = Mlp2(), inputs()  # two layers: the first and the last
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with flax_fp8.linen_fp8():
      variables = jax.eval_shape(model.init, jax.random.key(0), x)
  with pytest.warns(
    flax_fp8.Fp8PlacementWarning,
    match=r"No matmul of Mlp2 \(apply\) runs in fp8 \(inp: the first matmul layer "
    r"\(keep_first_last\); out: the last",
  ):
    with flax_fp8.linen_fp8():
      jax.eval_shape(model.apply, variables, x)


# NNX -----------------------------------------------------------------------------------


class NnxMlp(nnx.Module):
  def __init__(self, rngs, widths=WIDTHS):
    pairs = list(itertools.pairwise(widths[:-1]))
    self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in pairs])
    self.head = nnx.Linear(widths[-2], widths[-1], rngs=rngs)

  def __call__(self, x):
    for layer in self.hidden:
      x = jnp.tanh(layer(x))
    return self.head(x)


def nnx_run(model, x, **kwargs):
  """The NNX model made fp8 with ``kwargs``, its forward jaxpr's kernel dtypes and report."""
  flax_fp8.nnx_fp8(model, **kwargs)
  graphdef, state = nnx.split(model)
  with flax_fp8.placement_report() as report:
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  return model, kernel_dtypes(jaxpr.jaxpr), report


def fp8_state_paths(model):
  return {
    "/".join(str(p) for p in path[:-2])
    for path, _ in nnx.to_flat_state(nnx.state(model, flax_fp8.Fp8State))
  }


def test_nnx_default_keeps_the_first_and_last_layers_and_needs_an_example_call():
  x = inputs()
  with pytest.raises(
    ValueError, match="pass example_call=lambda model: model\\(x\\), or placement"
  ):
    flax_fp8.nnx_fp8(nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0))), fp8.DelayedScaling())
  model = nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0)))
  model, kernels, report = nnx_run(
    model, x, fp8_spec=fp8.DelayedScaling(), placement=NO_SHAPE_RULE, example_call=lambda m: m(x)
  )
  assert kernels == {(3, 4): "float32", (4, 5): "fp8", (5, 6): "fp8", (6, 2): "float32"}
  assert fp8_state_paths(model) == {"hidden/1", "hidden/2"}
  assert report.kept == {
    "hidden/0": "the first matmul layer (keep_first_last)",
    "head": "the last matmul layer (keep_first_last)",
  }


def test_nnx_kept_layers_compute_the_layer_s_own_matmul():
  x = inputs()
  model = NnxMlp(nnx.Rngs(0))
  plain = nnx.clone(model)
  flax_fp8.nnx_fp8(model, placement=fp8.Fp8Placement(exclude="hidden", keep_first_last=False))
  np.testing.assert_array_equal(nnx.jit(lambda m: m(x))(model), nnx.jit(lambda m: m(x))(plain))


@pytest.mark.parametrize(
  "placement, fp8_layers",
  [
    (fp8.ALL_LAYERS, {"hidden/0", "hidden/1", "hidden/2", "head"}),
    (
      fp8.Fp8Placement(exclude=r"^hidden/[12]$", keep_first_last=False, shape_rule=None),
      {"hidden/0", "head"},
    ),
    (
      fp8.Fp8Placement(include=(nnx.List,), keep_first_last=False, shape_rule=None),
      {"hidden/0", "hidden/1", "hidden/2"},
    ),
  ],
)
def test_nnx_filters_by_path_and_class(placement, fp8_layers):
  model = nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0)))
  model, kernels, report = nnx_run(
    model, inputs(), fp8_spec=fp8.DelayedScaling(), placement=placement
  )
  assert fp8_state_paths(model) == fp8_layers
  assert set(report.fp8) == fp8_layers
  assert sum(v == "fp8" for v in kernels.values()) == len(fp8_layers)


@pytest.mark.parametrize("tokens, expected", [(905, "float32"), (906, "fp8")])
def test_nnx_shape_rule_at_its_boundary(tokens, expected):
  d = 2048
  x = jax.ShapeDtypeStruct((tokens, 3), jnp.float32)
  model = nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0), widths=(3, d, d, 2)))
  # The example call runs abstractly: its arrays are traced, not computed.
  _, kernels, report = nnx_run(model, x, example_call=lambda m: m(jnp.zeros(x.shape)))
  assert kernels == {(3, d): "float32", (d, d): expected, (d, 2): "float32"}
  assert report.layers["hidden/1"].shape == (tokens, d, d)
  assert report.layers["hidden/1"].fp8 == (expected == "fp8")


def test_nnx_pattern_matching_no_layer_is_an_error_and_no_fp8_warns():
  model = nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0)))
  with pytest.raises(
    ValueError,
    match=r"pattern\(s\) 'heads' match no matmul layer of NnxMlp; its layers "
    r".* head, hidden/0, hidden/1, hidden/2",
  ):
    flax_fp8.nnx_fp8(model, placement=fp8.Fp8Placement(exclude="heads", keep_first_last=False))
  with pytest.warns(
    flax_fp8.Fp8PlacementWarning,
    match=r"No matmul of NnxMlp runs in fp8 \(head: excluded by NnxMlp; hidden/0: excluded",
  ):
    flax_fp8.nnx_fp8(model, placement=fp8.Fp8Placement(exclude=NnxMlp, keep_first_last=False))
  with pytest.raises(TypeError, match="example_call must be a function of the model, got 3"):
    flax_fp8.nnx_fp8(model, example_call=3)
