"""Kept so that imports from ``jmp_lite.dtypes`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._dtypes import *  # noqa: F403
from jmp_lite._dtypes import __all__ as __all__
