"""Kept so that imports from ``jmp_lite.dtypes`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._dtypes import (
  FORMATS,
  FormatInfo,
  dtype_name,
  format_info,
  half_dtype,
  half_dtype_for,
  is_float8,
  parse_dtype,
  scalar_type,
)

__all__ = [
  "FORMATS",
  "FormatInfo",
  "dtype_name",
  "format_info",
  "half_dtype",
  "half_dtype_for",
  "is_float8",
  "parse_dtype",
  "scalar_type",
]
