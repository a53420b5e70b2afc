"""The fast normal sampler: the same numbers for a key alone and inside any vmap over keys."""

import jax
import jax.numpy as jnp
import numpy as np

from iclab.tasks import rbg_key, standard_normal


def _keys(n):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(n))


def test_one_key_draws_the_rbg_stream():
    key = _keys(1)[0]
    np.testing.assert_array_equal(standard_normal(key, (4, 3)), jax.random.normal(rbg_key(key), (4, 3)))
    assert standard_normal(key, (2,), jnp.float32).dtype == jnp.float32


def test_vmapped_draws_equal_the_per_key_draws_under_nesting_jit_and_scan():
    keys = _keys(6)
    alone = np.stack([np.asarray(standard_normal(k, (3,))) for k in keys])
    np.testing.assert_array_equal(jax.vmap(lambda k: standard_normal(k, (3,)))(keys), alone)
    nested = jax.jit(jax.vmap(jax.vmap(lambda k: standard_normal(k, (3,)))))(keys.reshape(2, 3, 2))
    np.testing.assert_array_equal(nested.reshape(6, 3), alone)
    # a subset of the keys draws the same rows (plain RBG under vmap would draw them from keys[0])
    np.testing.assert_array_equal(jax.vmap(lambda k: standard_normal(k, (3,)))(keys[2:4]), alone[2:4])

    def loop(k):
        return jax.lax.scan(lambda c, i: (c, standard_normal(jax.random.fold_in(k, i), (2,))), 0, jnp.arange(3))[1]

    np.testing.assert_array_equal(jax.jit(jax.vmap(loop))(keys), np.stack([loop(k) for k in keys]))


def test_an_unbatched_key_beside_batched_values_broadcasts():
    key = _keys(1)[0]
    out = jax.vmap(lambda x: standard_normal(key, (3,)) * x)(jnp.arange(3.0))
    np.testing.assert_array_equal(out, jnp.outer(jnp.arange(3.0), standard_normal(key, (3,))))


def test_draws_are_standard_normal():
    z = np.asarray(standard_normal(_keys(1)[0], (200_000,)))
    assert abs(z.mean()) < 4 / np.sqrt(z.size) and abs(z.var() - 1) < 4 * np.sqrt(2 / z.size)


# The bits on the CPU come from a compiled kernel (iclab.ops.normals.native): XLA's RngBitGenerator bit for bit.

_STATES = [np.array(w, np.uint32) for w in ([0x12345678, 0x9ABCDEF0, 0x0FEDCBA9, 0x87654321], [1, 2, 3, 4],
                                             [0xDEADBEEF, 0, 0xFFFFFFF0, 0xFFFFFFFF],  # the counter's low half wraps
                                             [0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF])]


def test_native_bits_are_xlas_rng_bit_generator(monkeypatch):
    """The kernel's words equal ``lax.rng_bit_generator``'s (uint32 and uint64, shapes of every length mod 4, a
    counter that carries into its high half) on 1, 2 and 3 threads."""
    from iclab.ops.normals import native as _rbg_native

    for words in _STATES:
        for shape in ((1,), (3,), (5, 2), (2, 3, 7), (40_003,)):
            ref32 = np.asarray(jax.lax.rng_bit_generator(jnp.asarray(words), shape, dtype=jnp.uint32)[1])
            ref64 = np.asarray(jax.lax.rng_bit_generator(jnp.asarray(words), shape, dtype=jnp.uint64)[1])
            for threads in (1, 2, 3):
                monkeypatch.setattr(_rbg_native, "thread_count", lambda n=threads: n)
                got = _rbg_native.words_of_state(words, 2 * ref32.size)
                np.testing.assert_array_equal(got[:ref32.size].reshape(shape), ref32)
                np.testing.assert_array_equal(got.view(np.uint64).reshape(shape), ref64)
            for width, ref in ((32, ref32), (64, ref64)):
                np.testing.assert_array_equal(jax.jit(_rbg_native.random_bits, static_argnums=(1, 2))(
                    jnp.asarray(words), width, shape), ref)


def test_ir_blocks_are_numbas_blocks(monkeypatch):
    """The Philox blocks of the IR kernel (eight per step) against numba's loop, its naive twin: any range of
    blocks, a cut last block, counters whose low half wraps inside a step."""
    from iclab.ops.normals import native as _rbg_native
    from iclab.ops._runtime.philox import round_keys

    r = np.random.default_rng(7)
    for lo in (0, 2**64 - 3, 2**64 - 20, int(r.integers(0, 2**63))):
        rk, top = round_keys(0xDEADBEEF, 0x12345678), np.uint64(2**64 - 1 if lo else 12345)
        for n, first, stop in ((101, 0, 26), (101, 3, 26), (96, 0, 24), (64, 5, 13), (7, 0, 2)):
            outs = []
            for ir in (False, True):
                monkeypatch.setattr(_rbg_native, "IR_BLOCKS", ir)
                out = np.zeros(n, np.uint32)
                _rbg_native._blocks(rk, np.uint64(lo), top, out, first, stop)
                outs.append(out)
            np.testing.assert_array_equal(outs[1], outs[0])
            assert np.any(outs[0][4 * first: 4 * min(stop, n // 4)] != 0)


def test_native_bits_draw_the_same_normals_as_xlas(monkeypatch):
    """standard_normal with the kernel's bits and with XLA's RngBitGenerator: the same numbers in float32 and
    float64, for one key, under vmap (nested, jitted) and in a scan."""
    from iclab.tasks import _random

    keys = _keys(4)

    def draws(dtype):
        one = np.asarray(standard_normal(keys[1], (5, 3), dtype))
        batched = jax.jit(jax.vmap(jax.vmap(lambda k: standard_normal(k, (7,), dtype))))(keys.reshape(2, 2, 2))
        scanned = jax.jit(jax.vmap(lambda k: jax.lax.scan(
            lambda c, i: (c, standard_normal(jax.random.fold_in(k, i), (1141,), dtype)), 0, jnp.arange(2))[1]))(keys)
        return one, np.asarray(batched), np.asarray(scanned)

    for dtype in (jnp.float32, jnp.float64):
        got = {}
        for native in (False, True):
            monkeypatch.setattr(_random, "NATIVE_BITS", native)
            got[native] = draws(dtype)
        for a, b in zip(got[False], got[True]):
            assert a.dtype == dtype
            np.testing.assert_array_equal(a, b)


def test_half_precision_draws_keep_xlas_generator():
    """float16 draws need 16-bit words, which the kernel does not draw: they stay XLA's, the same as before."""
    key = _keys(1)[0]
    np.testing.assert_array_equal(standard_normal(key, (6,), jnp.float16),
                                  jax.random.normal(rbg_key(key), (6,), jnp.float16))
