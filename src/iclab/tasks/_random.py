"""Fast Gaussian draws inside jitted loops: XLA's RBG generator keyed by a threefry key, safe under vmap.

Why not ``jax.random.normal(key, ...)`` directly: XLA:CPU takes seconds to compile the partitionable
threefry sampler at every new shape and call site (RBG compiles in a fraction of that), which would
dominate a short sampled run. The RBG key is built from the two words of the threefry key
(the output of ``fold_in``/``split``, already well mixed) and their complement-mixed copies, so the
draws stay a pure function of the key and need no threefry call at all.

Why not ``jax.random.normal(rbg_key(key), ...)`` either: under ``vmap`` over keys, JAX batches XLA's
RngBitGenerator by drawing the whole batch from the FIRST key, so row s of a vmapped draw is not the
draw of key s (it depends on key 0 and on s's position in the batch). A seed would then get different
numbers alone and beside other seeds, and a member of a grid different numbers alone and inside it.
:func:`standard_normal` has its own batching rule: a vmapped call draws each key's numbers by itself
(a ``lax.map`` over the keys), so it equals the per-key draws exactly, under any nesting of vmap.

Under the native backend (:func:`iclab.ops.backend`) the RBG key's bits come from a compiled kernel (``NATIVE_BITS``, :mod:`iclab.ops.normals.native`): XLA's
RngBitGenerator, expanded into elementwise HLO that runs on one thread, is most of gating.fig2's batch; the
kernel draws the same words (Philox4x32-10 as XLA does, tested against ``lax.rng_bit_generator``) on every
thread, each key by itself under vmap, and ``jax.random.normal`` turns them into floats with its own XLA code, so
every draw is the same bits as XLA's. Under vmap one host call draws every key's words.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import custom_batching

from iclab.ops import backend

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


#: Whether the draws on the CPU take their bits from the compiled kernel of :mod:`iclab.ops.normals` (XLA's
#: RngBitGenerator bit for bit, on every thread; the floats are XLA's own transform of them, so the draws are the
#: same bits) rather than from XLA's RngBitGenerator (one thread; most of gating.fig2's batch).
NATIVE_BITS = True


def _native_key(key: jax.Array) -> jax.Array:
    """:func:`rbg_key`'s key data under the PRNG implementation whose bits come from the compiled kernel."""
    from iclab.ops import NATIVE_RNG_IMPL

    return jax.random.wrap_key_data(jax.random.key_data(rbg_key(key)), impl=NATIVE_RNG_IMPL)


@functools.lru_cache(maxsize=None)
def _sampler(shape: tuple[int, ...], dtype, native: bool):
    def one(key):
        return jax.random.normal(_native_key(key) if native else rbg_key(key), shape, dtype)

    @custom_batching.custom_vmap
    def draw(key):
        return one(key)

    @draw.def_vmap
    def _per_key(axis_size, in_batched, key):  # each key draws its own numbers, as it would alone
        (batched,) = in_batched
        if not batched:
            return draw(key), False
        # the kernel's bits are per key under vmap (one host call for all the keys, each key's words as it draws
        # them alone); XLA's RngBitGenerator's are not
        return (jax.vmap(one)(key) if native else jax.lax.map(draw, key)), True

    return draw


def standard_normal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float64) -> jax.Array:
    """N(0, 1) draws of the given shape from a raw (threefry) key, through :func:`rbg_key`.

    Equal to ``jax.random.normal(rbg_key(key), shape, dtype)`` for one key, and to those per-key draws
    row by row under ``vmap`` over keys (module docstring); under the native backend the bits come from a compiled
    kernel (``NATIVE_BITS``; the same bits).

    Args:
        key: a raw (2,) uint32 key.
        shape: the shape of the draw.
        dtype: float dtype of the draw.
    """
    # the kernel draws XLA's 32- and 64-bit words; narrower floats, and other backends, keep XLA's generator
    native = NATIVE_BITS and backend() == "native" and jnp.dtype(dtype).itemsize in (4, 8)
    return _sampler(tuple(int(s) for s in shape), jnp.dtype(dtype), native)(key)
