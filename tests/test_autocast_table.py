"""The op table (jmp_lite/_autocast/_table.py): which dtype each primitive runs in, the
default rows, overrides and own tables, and the checks of a table's entries."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl

from .autocast_testing import F32, POLICY, block, block_params, census, hand_written, rel_err


def test_census_matches_the_table():
  params, x = block_params(), jax.random.normal(jax.random.key(1), (8, 16))
  found = census(jax.make_jaxpr(jl.autocast(block, POLICY))(params, x))
  assert found["dot_general"] == {"bfloat16"}
  for primitive in ("exp", "rsqrt", "reduce_sum"):
    assert found[primitive] == {"float32"}, primitive
  assert found["reduce_max"] == {"bfloat16"}  # runs at its input dtype
  assert found["tanh"] == {"bfloat16"}  # not in the table: runs at its input dtype
  # The hand-written program runs exp and rsqrt in bf16.
  plain = census(jax.make_jaxpr(hand_written(block))(params, x))
  assert plain["exp"] == {"bfloat16"} and plain["rsqrt"] == {"bfloat16"}


def test_default_table_rows():
  table = jl.AUTOCAST_TABLE
  assert {p for p, r in table.items() if r == "compute"} == {"dot_general", "conv_general_dilated"}
  fp32 = {"exp", "log", "log1p", "expm1", "pow", "rsqrt", "sqrt", "erf_inv", "logistic"}
  fp32 |= {"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"}
  assert fp32 <= {p for p, r in table.items() if r == "float32"}
  assert table["reduce_max"] == table["reduce_min"] == "input"
  assert table["convert_element_type"] == "cast"
  with pytest.raises(TypeError):
    table["exp"] = "input"  # read-only


def test_fp32_ops_match_fp32_on_16bit_inputs():
  x = jnp.linspace(0.1, 0.9, 24).reshape(4, 6)
  fns = {
    "exp": jnp.exp, "log": jnp.log, "log1p": jnp.log1p, "expm1": jnp.expm1,
    "sqrt": jnp.sqrt, "rsqrt": jax.lax.rsqrt, "logistic": jax.nn.sigmoid,
    "pow": lambda a: a ** a, "erf_inv": jax.lax.erf_inv,
    "reduce_prod": lambda a: jnp.prod(a, -1), "cumsum": lambda a: jnp.cumsum(a, -1),
    "cumprod": lambda a: jnp.cumprod(a, -1), "cumlogsumexp": lambda a: jax.lax.cumlogsumexp(a, 1),
  }  # fmt: skip
  xb = x.astype(jnp.bfloat16)
  for name, fn in fns.items():
    # An fp32 argument is read unrounded by fp32 ops, and an fp32 output is their fp32 result.
    got = jl.autocast(fn, POLICY)(x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, fn(x), rtol=1e-6, err_msg=name)
    # A bf16 argument: the op runs in fp32 on its exact value.
    np.testing.assert_allclose(
      jl.autocast(fn, POLICY)(xb), fn(xb.astype(F32)), rtol=1e-6, err_msg=name
    )
    # The hand-written version runs it in bf16.
    assert rel_err(hand_written(fn)(x), fn(x)) > 1e-4, name


def test_long_sum_in_fp32():
  x = jnp.arange(64.0) / 8  # exact in bf16; its running sums need up to 11 bits
  want = np.cumsum(np.arange(64.0) / 8)
  np.testing.assert_array_equal(jl.autocast(jnp.cumsum, POLICY)(x), want)
  np.testing.assert_array_equal(jl.autocast(jnp.sum, POLICY)(x), want[-1])
  assert not np.array_equal(hand_written(jnp.cumsum)(x), want)


def test_unknown_primitive_runs_at_its_input_dtypes():
  x = jnp.linspace(0.5, 2.0, 6)
  got = jl.autocast(jnp.cbrt, POLICY)(x)
  want = jnp.cbrt(x.astype(jnp.bfloat16)).astype(F32)
  np.testing.assert_array_equal(got, want)
  assert census(jax.make_jaxpr(jl.autocast(jnp.cbrt, POLICY))(x))["cbrt"] == {"bfloat16"}


def test_overrides_and_own_table():
  x = jnp.linspace(0.0, 1.0, 4)
  f = lambda a: jnp.exp(a) @ jnp.ones((4, 2))
  assert census(jax.make_jaxpr(jl.autocast(f, POLICY, overrides={"exp": "input"}))(x))["exp"] == {
    "bfloat16"
  }
  found = census(jax.make_jaxpr(jl.autocast(f, POLICY, table={"dot_general": "float32"}))(x))
  assert found["exp"] == {"bfloat16"} and found["dot_general"] >= {"float32"}


def test_a_primitive_name_jax_lacks_is_warned_about():
  with pytest.warns(UserWarning, match=r"overrides\['expp'\]: JAX has no primitive"):
    jl.autocast(jnp.exp, POLICY, overrides={"expp": "input"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # real primitive names pass silently
    jl.autocast(jnp.exp, POLICY, overrides={"tanh": "float32", "exp": "input"})
