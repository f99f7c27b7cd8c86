"""Import time of ``import jmp_lite`` relative to ``import jax, optax`` (what it builds on).

Each round starts two fresh interpreters, one per import, in alternating order, and times the
import inside them (``time.perf_counter`` around the import statement, so interpreter start-up
is left out); the figure is the median of the per-round ratios. The target: at most 1.3.

  python -m benchmarks.import_time --rounds 21
"""

import argparse
import json
import statistics
import subprocess
import sys

BASELINE = "import jax, optax"
CANDIDATES = {"jmp_lite": "import jmp_lite", "jmp_lite.flax": "import jmp_lite.flax"}


def import_seconds(statement: str) -> float:
  """Seconds ``statement`` takes in a fresh interpreter."""
  code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return float(out.stdout)


def measure(rounds: int) -> dict:
  """Median ratio of each candidate's import time to the baseline's, over ``rounds``."""
  ratios: dict[str, list[float]] = {name: [] for name in CANDIDATES}
  baseline = []
  for i in range(rounds):
    for name, statement in CANDIDATES.items():
      pair = [BASELINE, statement] if i % 2 == 0 else [statement, BASELINE]
      seconds = dict(zip(pair, (import_seconds(s) for s in pair), strict=True))
      baseline.append(seconds[BASELINE])
      ratios[name].append(seconds[statement] / seconds[BASELINE])
  return {
    "baseline": BASELINE,
    "baseline_seconds": statistics.median(baseline),
    "median_ratio": {name: statistics.median(r) for name, r in ratios.items()},
    "rounds": rounds,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=21)
  print(json.dumps(measure(parser.parse_args().rounds), indent=2))


if __name__ == "__main__":
  main()
