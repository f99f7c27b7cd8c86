"""Current scaling, and the calibration pass that uses it before the first step (private).

The open :func:`current_scaling` scopes are ambient (``SCOPES``) because the
fp8 ops they change are called by the user's loss function (the closure
:func:`calibrate` receives) or by Flax layers, neither of which the scope's
opener can give an argument to; each scope also counts the probed ops traced
inside, the one way :func:`calibrate` can tell that ``fun`` traced none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jmp_lite._context import Ambient
from jmp_lite._fp8_config import Fp8Config, as_config
from jmp_lite.fp8._scaling import update, zeros_amax


class CurrentScalingScope:
  """What :func:`current_scaling` yields.

  Attributes:
    probed_ops: how many fp8 ops were traced inside with an amax probe (0:
      nothing would be observed).
  """

  def __init__(self) -> None:
    self.probed_ops = 0


# The open current_scaling() scopes, read by the fp8 ops when they are traced.
SCOPES: Ambient[CurrentScalingScope] = Ambient("jmp_lite.fp8.current_scaling")


@contextlib.contextmanager
def current_scaling() -> Iterator[CurrentScalingScope]:
  r"""Inside, fp8 ops quantize each tensor with the scale of its own amax.

  Read when an op is traced (as :func:`jax.named_scope` is): every
  :func:`dot_general` and :func:`einsum` traced inside quantizes its input,
  kernel and output gradient :math:`x` with

  .. math:: s = \texttt{compute\_scale}(\max|x|,\ s_{\text{state}},\ \text{dtype},\ \text{margin})

  instead of the state's scale :math:`s_{\text{state}}` (which it keeps only
  for an all-zero or non-finite tensor), and reports the amaxes through its
  probe as usual. Each quantization then waits for a reduction over its own
  tensor, which delayed scaling exists to avoid; :func:`calibrate` uses it for
  one pass before training.

  A ``jax.jit`` function traced before, outside the context, keeps its
  compiled delayed-scaling program: trace the fp8 ops inside.

  Returns:
    A context manager yielding a :class:`CurrentScalingScope` that counts the
    probed ops traced inside.
  """
  with SCOPES.scope(CurrentScalingScope()) as scope:
    yield scope


def calibrate(
  fun: Callable[..., Any],
  state: Any,
  config: Fp8Config | None = None,
  *,
  has_aux: bool = False,
  axis_name: Any = None,
) -> Any:
  r"""Sets the scales of a fresh fp8 state from one batch, before the first training step.

  Takes ``jax.grad(fun)(zeros_amax(state))`` once under :func:`current_scaling`
  and folds the observations into ``state`` with :func:`update`. No tensor is
  flushed or saturated in that pass, so every layer's output gradient is
  observed as it is. Each scale then maps its tensor's amax to the format's
  largest value,

  .. math:: s = \frac{\max|x| \cdot 2^{\text{margin}}}{\text{fp8\_max}},

  and a first training step on the same batch quantizes exactly as this pass
  did: its error is fp8 rounding, not a flush to zero or a saturation. Each
  call pushes one observation per tensor, so calibrating on several batches
  makes the ``"max"`` rule cover all of them. The training step itself is
  unchanged (``docs/fp8.md`` says why this is a separate pass).

  Args:
    fun: the loss of one batch as a function of the amax probes: ``fun(amax)``,
      closing over the parameters, the batch and ``state`` (e.g.
      ``lambda amax: loss_fn(params, amax)`` with the training step's loss).
      It need not scale the loss; if it does, it must pass the loss scale to
      the ops, as the training step does.
    state: the pytree of :class:`Fp8DotState` that ``fun`` reads, fresh from
      :func:`init_dot_state` or a Flax ``init``.
    config: formats, margin and amax rule (the ops' ``config``).
    has_aux: ``fun`` returns ``(loss, aux)``; ``aux`` is dropped.
    axis_name: as in :func:`update`.

  Returns:
    The calibrated state, with the same structure.

  Raises:
    ValueError: if ``state`` holds no :class:`Fp8DotState`, or ``fun`` traced
      no fp8 op with a probe (nothing would be calibrated).

  >>> from jmp_lite.fp8 import Fp8Config, dot_general, init_dot_state
  >>> config = Fp8Config(amax_history_length=4)
  >>> state = init_dot_state(config)
  >>> x, k = jnp.full((2, 3), 896.0), jnp.full((3, 2), 0.4375)
  >>> def loss(amax):  # output gradients of 57344 * 2**-40 ~ 2**-24: zero at scale 1
  ...   y = dot_general(x, k, (((1,), (0,)), ((), ())), state, amax, config=config)
  ...   return jnp.sum(y) * (57344 * 2.0**-40)
  >>> calibrated = jax.jit(calibrate, static_argnums=0)(loss, state)  # or eagerly
  >>> [float(t.scale) for t in calibrated]
  [2.0, 0.0009765625, 9.094947017729282e-13]
  """
  if not callable(fun):
    raise TypeError(f"fun must be a function of the amax probes, got {fun!r}.")
  config = as_config(config)
  probes = zeros_amax(state)
  if not jax.tree.leaves(probes):
    raise ValueError(f"state holds no Fp8DotState to calibrate: {state!r}.")
  with current_scaling() as scope:
    amax = jax.grad(fun, has_aux=has_aux)(probes)
  if scope.probed_ops == 0:
    raise ValueError(
      "fun traced no fp8 matmul with an amax probe, so nothing was calibrated: trace the fp8 "
      "ops inside fun (not a jax.jit function compiled before) and give them the probes (the "
      "amax argument; linen: the 'fp8_amax' collection)."
    )
  if has_aux:
    amax, _ = amax
  return update(state, amax, config, axis_name=axis_name)
