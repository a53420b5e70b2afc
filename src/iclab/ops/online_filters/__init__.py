"""LMS and RLS filters run over many streams at once, their tail errors, by a compiled kernel.

:mod:`.native`: blocks of 16 streams in numba; its reference is the vectorised filters of
:mod:`iclab.baselines` (``_online``), which it equals to rounding.
"""

from iclab.ops.online_filters.native import filter_tail_errors

__all__ = ["filter_tail_errors"]
