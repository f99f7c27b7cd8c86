"""What the tests of jl.audit share."""

import pathlib
from collections.abc import Callable


def line_finder(path: str) -> Callable[[str], int]:
  """``line_of(marker)``: the line of the file at ``path`` that carries ``# <marker>``."""
  source = pathlib.Path(path).read_text().splitlines()

  def line_of(marker: str) -> int:
    (line,) = [i + 1 for i, text in enumerate(source) if f"# <{marker}>" in text]
    return line

  return line_of


def checks(report) -> list[str]:
  return [f.check for f in report]
