"""Plain GD on the moments engine's quadratic loss L(T(θ)) = c − 2⟨T, m⟩ + Tᵀ G T, reduced linattn models.

:mod:`.native`: the whole loop in one compiled function per model and D (numba); its reference is the XLA
moments engine, :func:`iclab.engines.moments.full_batch`, which it follows to rounding.
"""

from iclab.ops.moments_step.native import NATIVE_MODELS as MOMENTS_MODELS
from iclab.ops.moments_step.native import NativeModel as MomentsModel
from iclab.ops.moments_step.native import plain_gd as moments_plain_gd

__all__ = ["MOMENTS_MODELS", "MomentsModel", "moments_plain_gd"]
