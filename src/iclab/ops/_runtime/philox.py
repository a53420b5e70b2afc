"""Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): its constants and the
generated source of its rounds, for the numba samplers (``ops.drift_sampler.native``, ``ops.normals.native``).

One round maps the counter (x0, x1, x2, x3) under the round key (ka, kb) to
(hi(M1·x2) ⊕ x1 ⊕ ka, lo(M1·x2), hi(M0·x0) ⊕ x3 ⊕ kb, lo(M0·x0)) (32 × 32 → 64-bit products); the key of round r
is (k0 + r·W0, k1 + r·W1) mod 2³².
"""

from __future__ import annotations

import numpy as np

__all__ = ["M0", "M1", "W0", "W1", "round_key_lines", "round_keys", "round_lines"]

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def round_key_lines() -> str:
    """Source lines (4 spaces in) binding ka0..ka9, kb0..kb9 to the rows of a (10, 2) ``round_keys`` array."""
    return "\n".join(f"    ka{r} = round_keys[{r}, 0]\n    kb{r} = round_keys[{r}, 1]" for r in range(10))


def round_lines() -> str:
    """Source lines (8 spaces in) of the ten rounds on uint64 x0..x3 holding 32-bit words (``mask``, ``hi`` = 32 and
    the round keys of :func:`round_key_lines` bound)."""
    lines = []
    for r in range(10):
        lines += [f"        p0 = np.uint64({M0}) * x0",
                  f"        p1 = np.uint64({M1}) * x2",
                  f"        x0, x1, x2, x3 = ((p1 >> hi) ^ x1 ^ ka{r}) & mask, p1 & mask, ((p0 >> hi) ^ x3 ^ kb{r}) & mask, "
                  "p0 & mask"]
    return "\n".join(lines)


def round_keys(k0: int, k1: int) -> np.ndarray:
    """The Philox4x32-10 key of each round, (10, 2) uint64: (k0 + r W0, k1 + r W1) mod 2³²."""
    r = np.arange(10, dtype=np.uint64)
    return np.stack([(np.uint64(k0) + r * np.uint64(W0)) & np.uint64(0xFFFFFFFF),
                     (np.uint64(k1) + r * np.uint64(W1)) & np.uint64(0xFFFFFFFF)], axis=1)
