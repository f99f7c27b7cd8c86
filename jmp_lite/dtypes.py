"""Kept so that imports from ``jmp_lite.dtypes`` keep working: the
implementation is private (``jmp_lite._dtypes``); use ``jmp_lite.<name>``.
"""

from jmp_lite._dtypes import (
  FORMATS as FORMATS,
)
from jmp_lite._dtypes import (
  FormatInfo as FormatInfo,
)
from jmp_lite._dtypes import (
  dtype_name as dtype_name,
)
from jmp_lite._dtypes import (
  format_info as format_info,
)
from jmp_lite._dtypes import (
  half_dtype as half_dtype,
)
from jmp_lite._dtypes import (
  half_dtype_for as half_dtype_for,
)
from jmp_lite._dtypes import (
  is_float8 as is_float8,
)
from jmp_lite._dtypes import (
  parse_dtype as parse_dtype,
)
from jmp_lite._dtypes import (
  scalar_type as scalar_type,
)
