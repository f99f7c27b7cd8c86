"""fp8 einsum (jmp_lite/fp8/_einsum.py) against jnp.einsum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8

from .fp8_testing import (
  small_integers,
  unit_state,
  value_and_vjp,
)

# einsum --------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "subscripts, lhs_shape, rhs_shape",
  [
    ("bd,df->bf", (3, 4), (4, 5)),
    ("btd,df->bft", (2, 3, 4), (4, 5)),
    ("bhd,hdf->bf", (3, 2, 4), (2, 4, 5)),
    ("bqhd,bkhd->bhqk", (2, 3, 2, 4), (2, 5, 2, 4)),
    ("...d,df->...f", (2, 3, 4), (4, 5)),
    ("...d,...df->...f", (2, 3, 4), (3, 4, 5)),
    ("ij,jk", (3, 4), (4, 5)),  # implicit output
    ("ba,ac", (3, 4), (4, 5)),
    ("bd,dfz->bf", (3, 4), (4, 5, 2)),  # z is summed away first
    ("i,j->ij", (3,), (4,)),
  ],
)
def test_einsum_matches_jnp_einsum(subscripts, lhs_shape, rhs_shape):
  state = unit_state()
  x, k = small_integers(lhs_shape, 6, 2), small_integers(rhs_shape, 7, 2)
  g = small_integers(jnp.einsum(subscripts, x, k).shape, 8, 2)
  got = value_and_vjp(lambda x, k: fp8.einsum(subscripts, x, k, state), x, k, g)
  want = value_and_vjp(lambda x, k: jnp.einsum(subscripts, x, k), x, k, g)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize(
  "subscripts, shapes, match",
  [
    ("ab,bc,cd->ad", ((2, 2), (2, 2)), "exactly two operands"),
    ("ii,ij->j", ((2, 2), (2, 3)), "Repeated index"),
    ("ab,bc->ac", ((2, 3, 4), (3, 4)), "do not fit the lhs operand of rank 3"),
    ("ab,bc->ac", ((2, 3), (4, 5)), "Index 'b' .* size 3 in lhs and 4 in rhs"),
    ("ab,bc->ad", ((2, 3), (3, 5)), "appear in no operand"),
    ("a1,1c->ac", ((2, 3), (3, 5)), "Invalid subscripts"),
  ],
)
def test_einsum_rejects_bad_subscripts(subscripts, shapes, match):
  state = unit_state()
  with pytest.raises(ValueError, match=match):
    fp8.einsum(subscripts, jnp.ones(shapes[0]), jnp.ones(shapes[1]), state)
