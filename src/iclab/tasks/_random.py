"""Fast Gaussian draws inside jitted loops: XLA's RBG generator keyed by a threefry key, safe under vmap.

Why not ``jax.random.normal(key, ...)`` directly: XLA:CPU takes seconds to compile the partitionable
threefry sampler at every new shape and call site (about 2-3 s here, against well under 1 s for RBG),
which would dominate a short sampled run. The RBG key is built from the two words of the threefry key
(the output of ``fold_in``/``split``, already well mixed) and their complement-mixed copies, so the
draws stay a pure function of the key and need no threefry call at all.

Why not ``jax.random.normal(rbg_key(key), ...)`` either: under ``vmap`` over keys, JAX batches XLA's
RngBitGenerator by drawing the whole batch from the FIRST key, so row s of a vmapped draw is not the
draw of key s (it depends on key 0 and on s's position in the batch). A seed would then get different
numbers alone and beside other seeds, and a member of a grid different numbers alone and inside it.
:func:`standard_normal` has its own batching rule: a vmapped call draws each key's numbers by itself
(a ``lax.map`` over the keys), so it equals the per-key draws exactly, under any nesting of vmap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import custom_batching

__all__ = ["rbg_key", "standard_normal"]


def rbg_key(key: jax.Array) -> jax.Array:
    """An RBG key derived from a raw (threefry) key: words (k0, k1, k0 ^ c, k1 ^ c), c = 0x9E3779B9.

    Draw through :func:`standard_normal`, not ``jax.random.*(rbg_key(key))``, wherever keys may be
    vmapped (module docstring).

    Args:
        key: a raw (2,) uint32 key or a typed threefry key.
    Returns:
        A typed RBG key.
    """
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    data = jnp.asarray(data, jnp.uint32)
    return jax.random.wrap_key_data(jnp.concatenate([data, data ^ jnp.uint32(0x9E3779B9)]), impl="rbg")


@functools.lru_cache(maxsize=None)
def _sampler(shape: tuple[int, ...], dtype):
    @custom_batching.custom_vmap
    def draw(key):
        return jax.random.normal(rbg_key(key), shape, dtype)

    @draw.def_vmap
    def _per_key(axis_size, in_batched, key):  # each key draws its own numbers, as it would alone
        (batched,) = in_batched
        if not batched:
            return draw(key), False
        return jax.lax.map(draw, key), True

    return draw


def standard_normal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float64) -> jax.Array:
    """N(0, 1) draws of the given shape from a raw (threefry) key, through :func:`rbg_key`.

    Equal to ``jax.random.normal(rbg_key(key), shape, dtype)`` for one key, and to those per-key draws
    row by row under ``vmap`` over keys (module docstring).

    Args:
        key: a raw (2,) uint32 key.
        shape: the shape of the draw.
        dtype: float dtype of the draw.
    """
    return _sampler(tuple(int(s) for s in shape), jnp.dtype(dtype))(key)
