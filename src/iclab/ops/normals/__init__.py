"""Counter-based random words: the Philox blocks of ``lax.rng_bit_generator``, drawn by a compiled kernel.

:mod:`.native`: eight Philox blocks at a time in LLVM IR (numba's scalar loop the naive twin and the tail);
the same words as ``jax.lax.rng_bit_generator`` with the Philox algorithm, its reference.
"""

from iclab.ops.normals.native import IMPL as NATIVE_RNG_IMPL
from iclab.ops.normals.native import random_bits

__all__ = ["NATIVE_RNG_IMPL", "random_bits"]
