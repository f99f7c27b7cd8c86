"""The shared argument checks (jmp_lite/_validation.py): values kept, errors typed and named."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import _validation as v

F32 = np.dtype(np.float32)


def test_check_int_bounds_optional_and_unbounded():
  assert v.check_int(np.int64(3), "n", 1) == 3 and type(v.check_int(np.int64(3), "n", 1)) is int
  assert v.check_int(None, "n", 1, optional=True) is None
  assert v.check_int(-2, "argnums", None) == -2  # no lower bound
  for value, minimum, optional, error, match in [
    (0, 1, False, ValueError, "n must be >= 1, got 0"),
    (1.0, 1, False, TypeError, r"n must be an int >= 1, got 1\.0\.$"),
    (True, 1, False, TypeError, "got True"),
    (None, 1, False, TypeError, "got None"),
    (1.5, 1, True, TypeError, r"n must be an int >= 1 or None, got 1\.5\.$"),
    ("1", None, False, TypeError, r"n must be an int, got '1'\.$"),
  ]:
    with pytest.raises(error, match=match):
      v.check_int(value, "n", minimum, optional=optional)


def test_check_bool_accepts_python_and_numpy_bools_only():
  assert v.check_bool(np.True_, "flag") is True and v.check_bool(False, "flag") is False
  for bad in (1, None, "yes", jnp.array(True)):
    with pytest.raises(TypeError, match=r"flag must be a bool, got "):
      v.check_bool(bad, "flag")


def test_check_choice_types_and_message():
  assert v.check_choice("b", "mode", ("a", "b")) == "b"
  with pytest.raises(ValueError, match=r"^mode must be one of 'a', 'b'; got 'c'\.$"):
    v.check_choice("c", "mode", ("a", "b"))
  with pytest.raises(TypeError, match=r"^mode must be one of 'a', 'b'; got None\.$"):
    v.check_choice(None, "mode", ("a", "b"))
  with pytest.raises(ValueError, match="got None"):  # type_error=False: any outsider is a value
    v.check_choice(None, "mode", ("a", "b"), type_error=False)
  with pytest.raises(TypeError, match="got array"):  # not compared elementwise
    v.check_choice(np.array(["a", "b"]), "mode", ("a", "b"))


def test_as_real_and_bounds():
  assert v.as_real(jnp.bfloat16(0.5), "x", "a number") == 0.5
  assert v.as_real(np.int32(3), "x", "a number") == 3.0
  for bad, error, match in [
    (True, TypeError, r"x must be a number, got True\.$"),
    (np.array(True), TypeError, "x must be a number"),
    ("1", TypeError, "got '1'"),
    (np.complex64(1), TypeError, "x must be a number"),
    (np.ones(2), ValueError, r"x must be a scalar, got shape \(2,\)"),
  ]:
    with pytest.raises(error, match=match):
      v.as_real(bad, "x", "a number")
  with pytest.raises(TypeError, match="static configuration"):
    jax.jit(lambda x: v.as_real(x, "x", "a number"))(1.0)
  assert v.as_bound(2.0**15, "b", np.dtype(np.float16)) == 2.0**15
  with pytest.raises(ValueError, match=r"b=65536.0 is not representable .* float16"):
    v.as_bound(2.0**16, "b", np.dtype(np.float16))
  with pytest.raises(ValueError, match=r"b must be positive and finite, got -1\.0"):
    v.as_bound(-1, "b", F32)


def test_as_bound_accepts_zero_and_warns_on_integers_only_when_asked():
  assert v.as_bound(0.0, "b", F32, allow_zero=True) == 0.0
  assert v.as_bound(jnp.asarray(-0.0), "b", F32, allow_zero=True) == 0.0
  with pytest.raises(ValueError, match=r"^b must be positive and finite, got 0\.0\.$"):
    v.as_bound(0.0, "b", F32)
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=r"^b must be a finite number >= 0, got "):
      v.as_bound(bad, "b", F32, allow_zero=True)
  for integer in (2, np.int64(2), jnp.asarray(2, jnp.int32)):
    with pytest.warns(UserWarning, match=r"^Expected floating type for b, got int32; it is"):
      assert v.as_bound(integer, "b", F32, warn_integer=True) == 2.0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert v.as_bound(2, "b", F32) == 2.0  # no warning unless asked
    assert v.as_bound(jnp.float16(2), "b", F32, warn_integer=True) == 2.0


def test_as_bounds_broadcasts_a_scalar_and_checks_each_stage():
  assert v.as_bounds(2, "b", 3, F32) == (2.0, 2.0, 2.0)
  assert v.as_bounds(np.array([1.0, 4.0]), "b", 2, F32) == (1.0, 4.0)
  with pytest.raises(ValueError, match=r"b must be a scalar or one value per stage \(3\)"):
    v.as_bounds([1.0, 2.0], "b", 3, F32)
  with pytest.raises(ValueError, match=r"positive and finite, got 0\.0"):
    v.as_bounds([1.0, 0.0], "b", 2, F32)
  with pytest.raises(ValueError, match="not representable"):
    v.as_bounds(1e-50, "b", 2, F32)
  with pytest.raises(TypeError, match="b must be a positive number, got 'x'"):
    v.as_bounds("x", "b", 2, F32)


def test_check_dtype_names_the_value_as_parsed_or_as_given():
  f32 = lambda d: d == F32
  assert v.check_dtype("f32", "d", f32, "float32") == F32
  with pytest.raises(ValueError, match=r"^d must be float32, got bfloat16\.$"):
    v.check_dtype("bf16", "d", f32, "float32")
  with pytest.raises(ValueError, match=r"^d must be float32, got 'bf16'\.$"):
    v.check_dtype("bf16", "d", f32, "float32", as_given=True)
  with pytest.raises(TypeError, match="not a floating-point dtype"):  # parse_dtype's own errors
    v.check_dtype("int8", "d", f32, "float32")
  with pytest.raises(ValueError, match="Unknown dtype name"):
    v.check_dtype("float17", "d", f32, "float32")
