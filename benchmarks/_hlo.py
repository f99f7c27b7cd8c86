"""What an optimized HLO module launches: kernels by kind, collectives, large buffers, bytes moved.

:func:`kernel_summary` reads the text of ``compiled.as_text()`` (any XLA backend). A *kernel* is
an instruction of a computation that runs on the device as a unit: an instruction of the entry
computation, or of a ``while`` body/condition or ``conditional`` branch reached from it, that is
not pure bookkeeping (``parameter``, ``constant``, ``bitcast``, ``tuple``, ``get-tuple-element``
and the control-flow instructions themselves). Fused computations are not walked: a fusion is
one kernel. A ``while`` with a ``known_trip_count`` counts its body that many times.

The bytes a kernel moves are estimated as a roofline does: the bytes of its distinct operands
plus the bytes of its result, each buffer read or written once. The sum over kernels is an upper
bound on what the program moves through HBM when nothing stays in caches between kernels (XLA's
TPU cost analysis, where available, is the compiler's own figure).
"""

from __future__ import annotations

import collections
import re
from typing import Any, NamedTuple

import numpy as np

# Bits per element of HLO's element types.
_BITS = {
  "pred": 8,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "f8e4m3fn": 8,
  "f8e5m2": 8,
  "f8e4m3": 8,
  "f8e5m2fnuz": 8,
  "f8e4m3fnuz": 8,
  "f8e4m3b11fnuz": 8,
  "f8e8m0fnu": 8,
  "s16": 16,
  "u16": 16,
  "f16": 16,
  "bf16": 16,
  "s32": 32,
  "u32": 32,
  "f32": 32,
  "s64": 64,
  "u64": 64,
  "f64": 64,
  "c64": 64,
  "c128": 128,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BOOKKEEPING = frozenset(
  {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "while", "conditional", "call"}
)
_COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-broadcast",
)
LARGE_BYTES = 64 * 2**20  # buffers at least this large are listed by shape


class Instruction(NamedTuple):
  name: str
  shape: str  # the result type as printed: "f32[8,16]{1,0}" or a tuple "(f32[2], bf16[3])"
  opcode: str
  rest: str  # operands and attributes, as printed


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (element type, dimensions) of each array in a printed HLO type."""
  found = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _BITS:
      found.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
  return found


def shape_bytes(shape: str) -> int:
  """Bytes of every array in a printed HLO type (a tuple's elements summed)."""
  return sum(int(np.prod(dims)) * _BITS[dtype] // 8 for dtype, dims in _arrays(shape))


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """The computations of an HLO module by name, and the name of the entry computation."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    # Headers start in the first column; instructions are indented.
    header = _HEADER.match(line) if not line[:1].isspace() else None
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    match = _INSTRUCTION.match(line) if current is not None else None
    if match:
      computations[current].append(Instruction(*match.groups()))
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _operands(rest: str) -> list[str]:
  """The operand names of an instruction (its text after the opening parenthesis)."""
  depth, end = 1, len(rest)
  for i, char in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", rest[:end])


def _trips(instruction: Instruction, computations: dict[str, list[Instruction]]) -> int:
  """How often a ``while`` runs: its known trip count, else the one bound its condition compares
  with (a ``scan`` before the passes that annotate it), else once."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instruction.rest)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%?([\w.\-]+)", instruction.rest)
  bounds = [
    int(bound.group(1))
    for i in computations.get(condition.group(1) if condition else "", [])
    if i.opcode == "constant" and (bound := re.match(r"(\d+)\)", i.rest))
  ]
  return bounds[0] if len(bounds) == 1 else 1


def _called(
  instruction: Instruction, computations: dict[str, list[Instruction]]
) -> list[tuple[str, int]]:
  """The computations a control-flow instruction runs, each with how many times it runs."""
  rest = instruction.rest
  if instruction.opcode == "while":
    times = _trips(instruction, computations)
    return [(name, times) for name in re.findall(r"(?:body|condition)=%?([\w.\-]+)", rest)]
  if instruction.opcode == "conditional":
    branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
    names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
    names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)
    return [(name, 1) for name in names]
  if instruction.opcode == "call":
    return [(name, 1) for name in re.findall(r"to_apply=%?([\w.\-]+)", rest)]
  return []


def kernel_summary(text: str) -> dict[str, Any]:
  """Kernels, collectives, large buffers and estimated bytes moved of an optimized HLO module.

  Args:
    text: ``compiled.as_text()`` of a compiled JAX program.

  Returns:
    A JSON-ready dict: ``kernels`` (launches by opcode, fusions by ``kind=``, e.g.
    ``"fusion:kLoop"``), ``kernel_count``, ``collectives`` (launches by opcode),
    ``large_buffers`` (``"f32[8,16,1024,1024]"`` -> how many kernels write one; results of at
    least :data:`LARGE_BYTES`), ``bytes_moved`` (the roofline estimate of the module
    docstring) and ``gemm_custom_calls`` (``custom_call_target`` -> launches).
  """
  computations, entry = parse(text)
  types = {i.name: i.shape for body in computations.values() for i in body}
  kernels: collections.Counter[str] = collections.Counter()
  collectives: collections.Counter[str] = collections.Counter()
  large: collections.Counter[str] = collections.Counter()
  targets: collections.Counter[str] = collections.Counter()
  moved = 0
  stack, seen = [(entry, 1)], set()
  while stack:
    name, times = stack.pop()
    for instruction in computations.get(name, []):
      for callee, more in _called(instruction, computations):
        if (callee, times * more) not in seen:
          seen.add((callee, times * more))
          stack.append((callee, times * more))
      if instruction.opcode in _BOOKKEEPING:
        continue
      kind = re.search(r"kind=(k\w+)", instruction.rest)
      key = f"fusion:{kind.group(1)}" if instruction.opcode == "fusion" and kind else None
      kernels[key or instruction.opcode] += times
      base = instruction.opcode.removesuffix("-start").removesuffix("-done")
      if base in _COLLECTIVES and not instruction.opcode.endswith("-done"):
        collectives[base] += times
      target = re.search(r'custom_call_target="([^"]+)"', instruction.rest)
      if target:
        targets[target.group(1)] += times
      operands = dict.fromkeys(_operands(instruction.rest))
      moved += times * (
        shape_bytes(instruction.shape) + sum(shape_bytes(types.get(op, "")) for op in operands)
      )
      for dtype, dims in _arrays(instruction.shape):
        if int(np.prod(dims)) * _BITS[dtype] // 8 >= LARGE_BYTES:
          large[f"{dtype}[{','.join(map(str, dims))}]"] += times
  return {
    "kernels": dict(sorted(kernels.items())),
    "kernel_count": sum(kernels.values()),
    "collectives": dict(sorted(collectives.items())),
    "large_buffers": dict(sorted(large.items(), key=lambda kv: (-shape_bytes(kv[0]), kv[0]))),
    "bytes_moved": moved,
    "gemm_custom_calls": dict(sorted(targets.items())),
  }


def collective_bytes(text: str) -> dict[str, dict[str, int]]:
  """Result bytes of the collectives an HLO module runs, by kind and dtype.

  Args:
    text: an HLO module's text with synchronous collectives (e.g. dumped right after SPMD
      partitioning, before a backend changes the collectives' types).

  Returns:
    ``{kind: {dtype: bytes}}``; a collective in a ``while`` body counts once per iteration.
  """
  computations, entry = parse(text)
  totals: dict[str, dict[str, int]] = {}
  stack = [(entry, 1)]
  while stack:
    name, times = stack.pop()
    for instruction in computations.get(name, []):
      stack += [(callee, times * more) for callee, more in _called(instruction, computations)]
      if instruction.opcode in _COLLECTIVES:
        by_dtype = totals.setdefault(instruction.opcode, {})
        for dtype, dims in _arrays(instruction.shape):
          size = times * int(np.prod(dims)) * _BITS[dtype] // 8
          by_dtype[dtype] = by_dtype.get(dtype, 0) + size
  return totals
