"""Shared helpers of the mhsa experiments."""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAPER = "mhsa"


def seed_keys(seed: int, seeds: int) -> jax.Array:
    """One key per seed: fold_in(PRNGKey(seed), s), s = 0..seeds−1. Returns (seeds, 2)."""
    base = jax.random.PRNGKey(seed)
    return jnp.stack([jax.random.fold_in(base, s) for s in range(seeds)])
