"""What the benchmarks share: the test MLP, timing in interleaved rounds, HLO summaries, output.

**Timing.** Every benchmark times its variants side by side in one process. Each round times
every variant on a few consecutive steps (:func:`time_steps`), in an order that rotates from one
round to the next (:func:`interleaved_rounds`; both at once: :func:`time_interleaved`); a
variant's figure is the median over rounds of its time divided by the reference's time *in the
same round* (:func:`median_ratio`). On a shared machine the load changes over seconds, and a
ratio is only fair if both sides saw the same load.

**HLO.** :func:`hlo_summary` reads a compiled step: fusions, instructions, conditionals and
while loops of its entry computation, and XLA's cost model (flops, bytes accessed).

Nothing here is a benchmark; ``python -m benchmarks.<name>`` runs one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import pathlib
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl

T = TypeVar("T")
R = TypeVar("R")

# ---------------------------------------------------------------------------------------------
# The test model


def init_mlp(key: jax.Array, widths: Sequence[int]) -> list[dict[str, jax.Array]]:
  r"""Parameters of an MLP: one ``{"w", "b"}`` dict per layer, in fp32.

  Args:
    key: a JAX random key (``jax.random.key`` or ``jax.random.PRNGKey``).
    widths: the input width, the hidden widths, then the output width.

  Returns:
    ``len(widths) - 1`` dicts; layer ``i`` has ``w`` of shape ``(widths[i], widths[i+1])``
    drawn from :math:`\mathcal{N}(0, 1/\text{fan\_in})` and ``b`` zeros.
  """
  params = []
  for n_in, n_out in itertools.pairwise(widths):
    key, sub = jax.random.split(key)
    params.append(
      {
        "w": jax.random.normal(sub, (n_in, n_out), jnp.float32) / np.sqrt(n_in),
        "b": jnp.zeros((n_out,), jnp.float32),
      }
    )
  return params


def nbytes(aval: Any) -> int:
  """Bytes of an array, abstract or not (anything with ``shape`` and ``dtype``)."""
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


# ---------------------------------------------------------------------------------------------
# Timing: interleaved rounds, median ratios


def interleaved_rounds(
  variants: Sequence[T], rounds: int, time_round: Callable[[T], R]
) -> dict[T, list[R]]:
  """Calls ``time_round(variant)`` for every variant in every round, the order rotating.

  Args:
    variants: the variants (hashable), in their first round's order; round ``r`` starts at
      variant ``r % len(variants)``.
    rounds: how many rounds.
    time_round: times one variant for one round (e.g. with :func:`time_steps`).

  Returns:
    ``{variant: [what time_round returned, one per round]}``.
  """
  out: dict[T, list[R]] = {v: [] for v in variants}
  for r in range(rounds):
    k = r % len(variants)
    for variant in [*variants[k:], *variants[:k]]:
      out[variant].append(time_round(variant))
  return out


def time_steps(step: Callable[[T, int], T], state: T, steps: int) -> tuple[T, float, float]:
  """Runs ``state = step(state, i)`` for ``i`` in ``range(steps)`` and waits for the result.

  Args:
    step: one step; ``i`` is the step's index in the round.
    state: the first step's input.
    steps: how many steps.

  Returns:
    The last state, then the wall-clock and the process's CPU seconds (all threads) per step.
    CPU time is less disturbed than wall-clock time by other jobs on a shared machine.
  """
  start, cpu_start = time.perf_counter(), time.process_time()
  for i in range(steps):
    state = step(state, i)
  state = jax.block_until_ready(state)
  return state, (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


def time_interleaved(
  advance: Mapping[T, Callable[[Any, int], Any]], states: dict[T, Any], rounds: int, steps: int
) -> tuple[dict[T, list[float]], dict[T, list[float]]]:
  """Times every variant's step in interleaved rounds, each variant carrying its own state.

  Args:
    advance: ``{variant: step}``; ``step(state, i)`` returns the next state.
    states: ``{variant: state}`` of every variant (compiled and warmed up); updated in place,
      so that each round continues where the variant's last round stopped.
    rounds: how many rounds (:func:`interleaved_rounds`).
    steps: steps per variant per round (:func:`time_steps`).

  Returns:
    ``({variant: wall-clock seconds per step, one per round}, {variant: CPU seconds ...})``.
  """

  def time_round(variant: T) -> tuple[float, float]:
    states[variant], wall, cpu = time_steps(advance[variant], states[variant], steps)
    return wall, cpu

  times = interleaved_rounds(list(advance), rounds, time_round)
  wall = {v: [w for w, _ in per_round] for v, per_round in times.items()}
  return wall, {v: [c for _, c in per_round] for v, per_round in times.items()}


def median_ratio(a: Sequence[float | None], b: Sequence[float | None]) -> float | None:
  """Median over rounds of ``a[r] / b[r]``, from the rounds where both have a time.

  Args:
    a: per-round times of a variant (``None`` where it did not run).
    b: per-round times of the reference, the same rounds.

  Returns:
    The median ratio, or ``None`` if no round has both.
  """
  ratios = [float(x / y) for x, y in zip(a, b, strict=True) if x and y]
  return statistics.median(ratios) if ratios else None


# ---------------------------------------------------------------------------------------------
# Compiled programs


def entry_computation(text: str) -> str:
  """The entry computation of an HLO module's text (from ``ENTRY`` to the end)."""
  return text[text.index("ENTRY") :]


def control_flow(text: str) -> dict[str, int]:
  """Conditionals and while loops anywhere in a compiled module's text.

  For benchmarks/gpu.py: a ``jl.loss_scaling`` step compiled for a GPU or TPU must have no more
  than the same step without scaling. There ``jl.all_finite`` is one fused ``all(isfinite)``
  reduction; a conditional would make XLA:GPU copy its predicate to the host and wait for it on
  every step. On XLA:CPU one conditional is expected: the exact fallback behind the cheap sum.

  Args:
    text: an HLO module (or one computation of it) as XLA prints it.

  Returns:
    ``{"conditionals": n, "while_loops": n}``.
  """
  return {
    "conditionals": len(re.findall(r"= \S+ conditional\(", text)),
    "while_loops": len(re.findall(r"= \S+ while\(", text)),
  }


def hlo_summary(compiled: Any) -> dict[str, Any] | None:
  """What a compiled step does, from its optimized HLO and XLA's cost model.

  Args:
    compiled: a ``jax.stages.Compiled``.

  Returns:
    ``fusions``, ``entry_ops`` (instructions), ``conditionals`` and ``while_loops`` of the
    entry computation; ``flops`` and ``bytes_accessed`` of the whole step as XLA's cost model
    estimates them (a conditional counts both branches; ``None`` where the backend has no
    model). ``None`` if ``compiled`` has no HLO text.
  """
  try:
    entry = entry_computation(compiled.as_text())
  except (AttributeError, ValueError):
    return None
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  return {
    "fusions": len(re.findall(r"= \S+ fusion\(", entry)),
    "entry_ops": entry.count("\n"),
    **control_flow(entry),
    "flops": cost.get("flops"),
    "bytes_accessed": cost.get("bytes accessed"),
  }


# ---------------------------------------------------------------------------------------------
# Provenance and output


def versions() -> str:
  """``backend=... jax=... optax=...``: the first line a benchmark prints."""
  return f"backend={jax.default_backend()} jax={jax.__version__} optax={optax.__version__}"


def core_version() -> str:
  """sha256 (12 hex digits) of jmp_lite's source files: which implementation was measured."""
  root = pathlib.Path(jl.__file__).parent
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(path.relative_to(root).as_posix().encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()[:12]


def error_text(e: BaseException) -> str:
  """``"TypeName: first line of the message"`` (at most 300 characters): an error, recorded."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def finish(report: str, result: R, json_path: str | None, indent: int = 1) -> R:
  """Prints a benchmark's report and, if asked, writes its figures as JSON.

  Args:
    report: the tables, as text.
    result: the figures (JSON-serializable).
    json_path: where to write them (``--json``), or ``None``.
    indent: JSON indentation.

  Returns:
    ``result``, for ``main`` to return.
  """
  print(report)
  if json_path:
    write_json(json_path, result, indent)
  return result


def write_json(path: str, result: Any, indent: int = 1) -> None:
  """Writes ``result`` as JSON to ``path``, creating its folder.

  Args:
    path: the file.
    result: JSON-serializable figures.
    indent: JSON indentation.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=indent)
