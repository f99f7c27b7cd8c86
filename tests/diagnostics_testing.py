"""What the tests of jmp_lite.diagnostics share."""

import functools

import jax
import numpy as np

from jmp_lite import diagnostics as diag

# The tests check values, not speed: compiled with XLA's backend optimizations off (on 2 CPU
# cores compiling dominates their run time).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def stats_of(grads, **kwargs):
  return jit(lambda g: diag.gradient_statistics(g, **kwargs))(grads)


def as_float(x) -> float:
  return float(np.asarray(x))
