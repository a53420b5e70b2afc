"""Fast Gaussian draws inside jitted loops: XLA's RBG generator keyed by a threefry key.

Why not ``jax.random.normal(key, ...)`` directly: XLA:CPU takes seconds to compile the partitionable
threefry sampler at every new shape and call site (about 2-3 s here, against well under 1 s for RBG),
which would dominate a short sampled run. The RBG key is built from the two words of the threefry key
(the output of ``fold_in``/``split``, already well mixed) and their complement-mixed copies, so the
draws stay a pure function of the key and need no threefry call at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rbg_key", "standard_normal"]


def rbg_key(key: jax.Array) -> jax.Array:
    """An RBG key derived from a raw (threefry) key: words (k0, k1, k0 ^ c, k1 ^ c), c = 0x9E3779B9.

    Args:
        key: a raw (2,) uint32 key or a typed threefry key.
    Returns:
        A typed RBG key, for ``jax.random.normal(rbg_key(key), ...)`` and the other samplers.
    """
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    data = jnp.asarray(data, jnp.uint32)
    return jax.random.wrap_key_data(jnp.concatenate([data, data ^ jnp.uint32(0x9E3779B9)]), impl="rbg")


def standard_normal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float64) -> jax.Array:
    """N(0, 1) draws of the given shape from a (threefry) key, through :func:`rbg_key`.

    Args:
        key: a raw (2,) uint32 key.
        shape: the shape of the draw.
        dtype: float dtype of the draw.
    """
    return jax.random.normal(rbg_key(key), shape, dtype)
