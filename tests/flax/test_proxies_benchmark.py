"""The CPU proxies of GPU cost (benchmarks/proxies.py): its counters and its targets."""

import json
import math

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from benchmarks import proxies


@jax.custom_vjp
def _cube(x):
  return x * x * x


_cube.defvjp(lambda x: (_cube(x), x), lambda x, g: (3 * x * x * g,))


def test_jaxpr_bytes_counts_each_equation_once_per_execution():
  def f(x, w, p):
    h = jax.jit(lax.dot)(x, w)  # a matmul: 4 * 8 * 4 bytes
    h = jax.checkpoint(lax.tanh)(h)  # 128 bytes
    h, _ = lax.scan(lambda c, _: (lax.dot(c, w), None), h, None, length=3)  # 3 matmuls
    # cond: the predicate (bool, then its int32 index: 1 + 4 bytes) and the larger branch.
    h = lax.cond(p, lax.neg, lambda h: lax.exp(lax.neg(h)), h)
    return _cube(h)  # two multiplies in the custom_vjp's primal jaxpr

  closed = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.int32(1))
  tile = 4 * 8 * 4
  assert proxies.jaxpr_bytes(closed) == {
    "matmul_output": tile + 3 * tile,
    "intermediate": tile + tile + 3 * tile + (1 + 4) + 2 * tile + 2 * tile,
  }
  # A 16-bit matmul writes half the bytes.
  half = jax.make_jaxpr(lax.dot)(jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16))
  assert proxies.jaxpr_bytes(half) == {"matmul_output": tile // 2, "intermediate": tile // 2}


_HLO = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[32,8]{1,0}}

%region_0.1 (x: f32[], y: f32[]) -> f32[] {
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main.2 (param: f32[4,8], param.1: bf16[8]) -> f32[32,8] {
  %param = f32[4,8]{1,0} parameter(0), sharding={devices=[8,1]<=[8]}
  %all-gather = f32[32,8]{1,0} all-gather(%param), channel_id=1, replica_groups=[1,8]<=[8], \
dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/all-gather(x)"}
  %all-gather.1 = bf16[64]{0} all-gather(%param.1), channel_id=2, dimensions={0}
  %all-reduce = (f32[8]{0}, bf16[8,2]{1,0}) all-reduce(%a, %b), channel_id=3, to_apply=%region_0.1
  %reduce-scatter = bf16[1,8]{1,0} reduce-scatter(%c), channel_id=4, dimensions={0}, \
to_apply=%region_0.1
  %all-to-all = s32[8,2]{1,0} all-to-all(%d), channel_id=5, dimensions={0}
  %dot = f32[32,8]{1,0} dot(%all-gather, %e), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %collective-permute = f32[32,8]{1,0} collective-permute(%dot), source_target_pairs={{0,1}}
}
"""


def test_collective_bytes_sums_results_by_kind_and_dtype():
  assert proxies.collective_bytes(_HLO) == {
    "all-gather": {"f32": 32 * 8 * 4, "bf16": 64 * 2},
    "all-reduce": {"f32": 8 * 4, "bf16": 16 * 2},  # a variadic all-reduce: both results
    "reduce-scatter": {"bf16": 8 * 2},
    "all-to-all": {"s32": 16 * 4},
    "collective-permute": {"f32": 32 * 8 * 4},
  }
  assert proxies.collective_bytes("ENTRY %m { ROOT %dot = f32[2]{0} dot(%a, %b) }") == {}


@pytest.mark.parametrize(
  ("line", "match"),
  [
    ("%ags = (f32[4]{0}, f32[32]{0}) all-gather-start(%p), dimensions={0}", "asynchronous"),
    ("%ag = f4e2m1fn[32]{0} all-gather(%p), dimensions={0}", "f4e2m1fn"),
  ],
)
def test_collective_bytes_rejects_what_it_cannot_count(line, match):
  with pytest.raises(ValueError, match=match):
    proxies.collective_bytes(f"ENTRY %m {{\n  {line}\n}}")


def test_fsdp_spec_shards_the_first_axis_where_it_divides():
  assert proxies.fsdp_spec((32, 4)) == P("fsdp")
  assert proxies.fsdp_spec((2, 16, 32)) == P()
  assert proxies.fsdp_spec(()) == P()
  with pytest.raises(ValueError, match="12"):
    proxies.collective_proxies(proxies.QUICK, 12)


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("proxies_benchmark")


def _elements(keep):
  """How many elements the quick model's parameters ``keep(path, leaf)`` accepts have."""
  params, _ = proxies._abstract_setup(proxies.QUICK, 8)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return sum(math.prod(x.shape) for path, x in leaves if keep(jax.tree_util.keystr(path), x))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  # The FSDP step compiles (and never runs) in a subprocess with 8 host devices.
  path = tmp_path_factory.mktemp("proxies") / "proxies.json"
  proxies.main(["--quick", "--json", str(path)])
  return json.loads(path.read_text())


def test_quick_run_measures_against_references(quick):
  figures = quick["figures"]
  # The same matmuls, 32-bit instead of 16-bit outputs.
  assert figures["fp32"]["matmul_output"] == 2 * figures["flax_bf16"]["matmul_output"]
  # fp32 FSDP: each sharded parameter is gathered in f32 for the forward pass; the backward
  # reuses the gathered matrices, and may gather a vector again (a LayerNorm scale).
  params, _ = proxies._abstract_setup(proxies.QUICK, 8)
  sharded = [x for x in jax.tree.leaves(params) if proxies.fsdp_spec(x.shape) != P()]
  matrices = sum(math.prod(x.shape) * 4 for x in sharded if x.ndim > 1)
  vectors = sum(math.prod(x.shape) * 4 for x in sharded if x.ndim == 1)
  assert figures["fp32"]["collectives"]["all-gather"].keys() == {"f32"}
  gathered = figures["fp32"]["collectives"]["all-gather"]["f32"]
  assert matrices + vectors <= gathered <= matrices + 2 * vectors
  assert all(d.keys() == {"f32"} for d in figures["fp32"]["collectives"].values())
  # Flax dtype=bf16: every sharded parameter but the LayerNorms' is cast to bf16 and gathered
  # once; the LayerNorm parameters are gathered in f32, a scale maybe again (as above).
  norms = _elements(lambda path, x: "LayerNorm" in path and proxies.fsdp_spec(x.shape) != P())
  rest = _elements(lambda path, x: "LayerNorm" not in path and proxies.fsdp_spec(x.shape) != P())
  assert figures["flax_bf16"]["collectives"]["all-gather"]["bf16"] == 2 * rest
  assert 4 * norms <= figures["flax_bf16"]["collectives"]["all-gather"]["f32"] <= 2 * 4 * norms


def test_quick_run_meets_the_targets(quick):
  # Matmul outputs, residuals, collectives <= 1.0x Flax bf16; all intermediates <= 1.15x.
  assert quick["targets"] == proxies.TARGETS
  assert quick["ratios"]["flax_bf16"] == dict.fromkeys(proxies.TARGETS, 1.0)
  # Judged after taking out the two deliberate fp32 choices, and only those: the
  # raw excess over Flax is at most what they cost.
  figures, allowed = quick["figures"], quick["deliberate_fp32"]
  assert {m for m, extra in allowed.items() if extra} == {"matmul_output", "collective"}
  for metric in ("matmul_output", "collective"):
    excess = figures["jmp_lite"][metric] - figures["flax_bf16"][metric]
    assert 0 < excess <= allowed[metric], (metric, excess, allowed[metric])
  judged = quick["judged"]
  misses = {m: judged[m] for m, target in proxies.TARGETS.items() if judged[m] > target}
  assert not misses, misses
  assert all(quick["met_less_deliberate_fp32"].values())
  assert quick["met"]["intermediate"] and quick["met"]["residual"]  # as the issue states them


def test_grad_reduction_dtype_sets_the_dtype_of_the_gradient_reduction(quick):
  # Default: kernel gradients are reduced in bf16, as Flax's bf16 layers do; with
  # grad_reduction_dtype=float32 they are reduced in f32 (the same elements, 2x bytes).
  default = quick["figures"]["jmp_lite"]["collectives"]["all-reduce"]
  wide = quick["figures"]["jmp_lite_f32_reduction"]["collectives"]["all-reduce"]
  # Every gradient is all-reduced once, and the loss (one f32). In f32: those of the fp32
  # islands (the embedding table, the LayerNorms) and of the head's bias (the fp32 logits'
  # bias); with grad_reduction_dtype=float32, the kernels' too.
  islands = lambda path: "Embed" in path or "LayerNorm" in path or path == "['Dense_0']['bias']"
  f32 = _elements(lambda path, x: islands(path))
  kernels = _elements(lambda path, x: path.endswith("['kernel']"))
  total = _elements(lambda path, x: True)
  assert default == {"bf16": 2 * (total - f32), "f32": 4 * (f32 + 1)}
  assert wide == {"bf16": 2 * (total - f32 - kernels), "f32": 4 * (f32 + kernels + 1)}
  gathers = lambda name: quick["figures"][name]["collectives"]["all-gather"]
  assert gathers("jmp_lite_f32_reduction") == gathers("jmp_lite")  # the forward is unchanged
  # The 16-bit parameters are gathered once, as Flax's are (not again for the backward pass).
  sharded_16_bit = lambda path, x: not islands(path) and proxies.fsdp_spec(x.shape) != P()
  assert gathers("jmp_lite")["bf16"] == 2 * _elements(sharded_16_bit)
