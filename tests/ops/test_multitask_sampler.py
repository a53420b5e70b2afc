"""The compiled labels and tokens of block prompts (ops.multitask_sampler.native) against numpy and XLA's path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.tasks import multitask as mt
from iclab.ops.multitask_sampler import native as mn


def _reference(w, tasks, contexts, n_max, sigma, qc, rows):
    """The prompts laid out by a numpy loop: labels by ``label_sum`` (the kernel's order), tokens row by row."""
    P, B, K1, d = tasks.shape
    K, p, n = K1 - 1, contexts.shape[1], (K1 - 1) * n_max
    x = w[:, K1 * d: K1 * d + (n + 1) * d].reshape(B, n + 1, d)
    eps = w[:, K1 * d + (n + 1) * d:]
    owner = np.concatenate([np.repeat(np.arange(K), n_max), [K]])
    y = mn.label_sum(x[None] * tasks[:, :, owner]) + np.float32(sigma) * eps[None]  # (P, B, n+1)
    delim = np.zeros((rows, B, n + K + 1, d + 1 + p), np.float32)
    plain = np.zeros((rows, B, n + 1, d + 1), np.float32)
    for q in range(rows):
        t = 0
        for k in range(K):
            for r in range(n_max):
                i = k * n_max + r
                delim[q, :, t] = np.concatenate([x[:, i], y[q, :, i, None], np.broadcast_to(contexts[0], (B, p))], 1)
                plain[q, :, i] = np.concatenate([x[:, i], y[q, :, i, None]], 1)
                t += 1
            delim[q, :, t, d + 1:] = contexts[k + 1]
            t += 1
        delim[q, :, t, :d] = x[:, n]
        plain[q, :, n, :d] = x[:, n]
        if qc is not None:
            delim[q, :, t, d + 1:] = contexts[qc]
    return {"delim": delim, "plain": plain}, y[:, :, n]


def _draw(seed, P, B, K, n_max, d, p):
    r = np.random.default_rng(seed)
    w = r.standard_normal((B, mn.draw_width(K, K * n_max, d))).astype(np.float32)
    tasks = r.standard_normal((P, B, K + 1, d)).astype(np.float32)
    contexts = r.standard_normal((K + 1, p)).astype(np.float32)
    return w, tasks, contexts


def test_label_sum_is_eight_lanes_added_pairwise():
    r = np.random.default_rng(0)
    for d in (1, 3, 8, 10, 16, 21):
        v = r.standard_normal((50, d)).astype(np.float32)
        lanes = [np.float32(0)] * 8
        for c in range(d):
            lanes[c % 8] = v[:, c] if c < 8 else np.float32(lanes[c % 8] + v[:, c])
        lanes = [np.broadcast_to(np.float32(a), (50,)).astype(np.float32) for a in lanes]
        want = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
        np.testing.assert_array_equal(mn.label_sum(v), want)
        np.testing.assert_allclose(mn.label_sum(v), v.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("P,rows,K,n_max,d,p,sigma,qc", [
    (1, 1, 2, 5, 10, 5, 0.0, 0),     # gating.fig2's shape, small
    (4, 1, 2, 3, 10, 5, 0.5, None),  # gating.fig1's panels sharing their tokens, a zero query context
    (3, 3, 3, 2, 3, 2, 0.3, 2),      # narrow inputs, every setting its tokens
    (2, 2, 2, 4, 21, 4, 1.0, 0),     # more than two chunks of eight lanes
    (1, 1, 2, 0, 4, 3, 0.0, 0),      # n̄ = 0: delimiters and the query only
])
def test_block_tokens_equal_the_numpy_layout_bit_for_bit(P, rows, K, n_max, d, p, sigma, qc):
    B = 7
    w, tasks, contexts = _draw(1, P, B, K, n_max, d, p)
    tokens, y_query = mn.block_tokens(jnp.asarray(w), jnp.asarray(tasks), jnp.asarray(contexts), n_max=n_max,
                                      sigma=sigma, query_context=qc, formats=("delim", "plain"), token_rows=rows)
    want, want_y = _reference(w, tasks, contexts, n_max, sigma, qc, rows)
    np.testing.assert_array_equal(np.asarray(y_query), want_y)
    for fmt in ("delim", "plain"):
        np.testing.assert_array_equal(np.asarray(tokens[fmt]), want[fmt])
    # one format alone is the same array
    alone, _ = mn.block_tokens(jnp.asarray(w), jnp.asarray(tasks), jnp.asarray(contexts), n_max=n_max, sigma=sigma,
                               query_context=qc, formats=("plain",), token_rows=rows)
    assert set(alone) == {"plain"}
    np.testing.assert_array_equal(np.asarray(alone["plain"]), want["plain"])


@pytest.mark.parametrize("B,block", [(7, 4), (7, 16), (32, 16)])
def test_blocked_delimiter_tokens_are_the_rows_in_lanes(B, block):
    w, tasks, contexts = _draw(4, 2, B, 2, 3, 10, 5)
    args = (jnp.asarray(w), jnp.asarray(tasks), jnp.asarray(contexts))
    kw = dict(n_max=3, sigma=0.2, query_context=0, formats=("delim", "plain"))
    rows_, y_rows = mn.block_tokens(*args, **kw)
    blocked, y_blocked = mn.block_tokens(*args, **kw, block=block)
    nb = -(-B // block)
    tb = np.asarray(blocked["delim"])
    assert tb.shape == (2, nb, 9, 16, block)
    want = np.zeros((2, nb * block, 9, 16), np.float32)
    want[:, :B] = np.asarray(rows_["delim"])
    np.testing.assert_array_equal(tb, want.reshape(2, nb, block, 9, 16).transpose(0, 1, 3, 4, 2))
    np.testing.assert_array_equal(np.asarray(blocked["plain"]), np.asarray(rows_["plain"]))
    np.testing.assert_array_equal(np.asarray(y_blocked), np.asarray(y_rows))


def test_block_tokens_match_sample_blocks_labels_and_vmap_over_seeds():
    """Against XLA's path: sample_blocks' prompts (labels to rounding: XLA's reduction order is its own), and the
    vmapped call (one host call for the seeds) equals each seed's call."""
    K, n_max, d, p, B, sigma = 2, 6, 10, 5, 9, 0.7
    factors = jnp.asarray(np.stack([mt.two_task_factor(r1=r1, r2=r2) for r1, r2 in ((0, 1), (0.5, 0.8))]),
                          jnp.float32)
    contexts = jnp.asarray(np.random.default_rng(2).standard_normal((3, K + 1, p)), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), 3)

    def native(key, ctx):
        w = mt.block_draw(key, B, [n_max] * K, d, jnp.float32)
        tasks = jax.vmap(lambda L: mt.block_tasks(w, L, K, d))(factors)
        return mn.block_tokens(w, tasks, ctx, n_max=n_max, sigma=sigma, query_context=0, formats=("plain",))

    def xla(key):
        return jax.vmap(lambda L: mt.sample_blocks(key, B, [n_max] * K, L, None, sigma, d=d, dtype=jnp.float32))(
            factors)

    batched = jax.jit(jax.vmap(native))(keys, contexts)
    for s in range(3):
        one = jax.jit(native)(keys[s], contexts[s])
        np.testing.assert_array_equal(np.asarray(batched[0]["plain"][s]), np.asarray(one[0]["plain"]))
        np.testing.assert_array_equal(np.asarray(batched[1][s]), np.asarray(one[1]))
        pr = xla(keys[s])
        tok = np.asarray(one[0]["plain"])
        np.testing.assert_array_equal(tok[:, :, :-1, :d], np.asarray(pr.x))
        np.testing.assert_array_equal(tok[:, :, -1, :d], np.asarray(pr.x_query))
        np.testing.assert_allclose(tok[:, :, :-1, d], np.asarray(pr.y), rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(np.asarray(one[1]), np.asarray(pr.y_query), rtol=2e-6, atol=2e-6)
        assert np.all(tok[:, :, -1, d] == 0)


def test_block_tokens_refuse_other_dtypes_and_widths():
    w, tasks, contexts = _draw(0, 1, 2, 2, 3, 4, 2)
    with pytest.raises(ValueError, match="float32"):
        mn.block_tokens(jnp.asarray(w, jnp.float64), jnp.asarray(tasks), jnp.asarray(contexts), n_max=3, sigma=0.0,
                        query_context=0)
    with pytest.raises(ValueError, match="width"):
        mn.block_tokens(jnp.asarray(w[:, :-1]), jnp.asarray(tasks), jnp.asarray(contexts), n_max=3, sigma=0.0,
                        query_context=0)


def test_task_normals_are_the_draws_first_columns_under_vmap():
    w = jnp.asarray(np.random.default_rng(5).standard_normal((3, 4, mn.draw_width(2, 6, 5))), jnp.float32)
    G = jax.jit(jax.vmap(lambda v: mn.task_normals(v, 2, 5)))(w)
    np.testing.assert_array_equal(np.asarray(G), np.asarray(w[:, :, :15]))
    np.testing.assert_array_equal(np.asarray(mn.task_normals(w[0], 2, 5)), np.asarray(w[0, :, :15]))
