"""A standard transformer for in-context regression: GPT-2's pre-LayerNorm blocks over (x, y) tokens.

The setting of Garg et al. (2022) and Raventós et al. (2023), beside which the theory models of the four papers
are usually compared. A prompt (x_1, y_1, …, x_N, y_N, x_q) is read as T = 2N + 1 tokens of width D + 1,

    x_n ↦ [x_n; 0],    y_n ↦ [0_D; y_n],    x_q ↦ [x_q; 0],

(the last channel tells a label from an input, so no position is needed to find the pairs; optional learned
positional embeddings add GPT-2's), read in by a linear map to width E, passed through L blocks

    h ← h + MHA(LN₁(h)),    h ← h + W₂ GELU(W₁ LN₂(h) + b₁) + b₂,

with causal softmax multi-head attention (H heads of width E/H, scores scaled by 1/√(E/H), GPT-2's tanh
GELU and a 4E hidden MLP), a final LayerNorm, and read out linearly: the prediction for y_q is the read-out at
the last token (x_q's). Every token's read-out is returned by :func:`outputs`, so the same model trains on the
prediction of every label (Garg et al.'s loss) or of the query's alone.

:func:`outputs` computes every position at once (batched matrix products with a causal mask);
:func:`naive_outputs` is its reference: a plain loop over tokens and heads, each token attending to the ones
before it by an explicit softmax. tests/models/test_transformer.py compares outputs and gradients in float64.

Params (one model; the L blocks stacked on a leading axis): ``read_in`` (D+1, E) and ``read_in_bias`` (E,),
``positions`` (T_max, E) (T_max = 0: none), ``blocks`` {``ln1_scale``, ``ln1_bias``, ``ln2_scale``,
``ln2_bias`` (L, E), ``qkv`` (L, E, 3, H, E/H), ``qkv_bias`` (L, 3, H, E/H), ``proj`` (L, H, E/H, E),
``proj_bias`` (L, E),
``mlp_in`` (L, E, 4E), ``mlp_in_bias`` (L, 4E), ``mlp_out`` (L, 4E, E), ``mlp_out_bias`` (L, E)},
``ln_scale``, ``ln_bias`` (E,), ``read_out`` (E,) and ``read_out_bias`` (). The heads are read from the shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from iclab.models._family import ModelFamily, register_model

__all__ = ["FAMILY", "init_transformer", "linreg_tokens", "naive_outputs", "outputs", "predict"]

LN_EPS = 1e-5  # GPT-2's LayerNorm epsilon


def init_transformer(key: jax.Array, *, D: int, H: int = 2, layers: int = 2, width: int = 32, w_init: float = 0.02,
                     max_tokens: int = 0, R: int = 1, dtype=jnp.float64) -> dict:
    """GPT-2's initialisation: weights N(0, w_init²), the blocks' output projections N(0, w_init²/(2L)), biases
    0, LayerNorm scales 1.

    Args:
        key: the init key.
        D: input dimension (tokens have D + 1 channels).
        H: attention heads per block (``width`` must be a multiple of H).
        layers: blocks L ≥ 1.
        width: the residual stream's width E.
        w_init: the weights' standard deviation (GPT-2: 0.02).
        max_tokens: length of the learned positional embeddings (0: none; else at least the prompt's 2N + 1).
        R: ignored (the linreg families' init keywords).
        dtype: the params' dtype.
    Returns:
        The params of one model (module docstring).
    """
    del R
    if layers < 1 or H < 1 or width < 1 or width % H:
        raise ValueError(f"width {width} must be a positive multiple of H = {H}, and layers ≥ 1 (got {layers})")
    E, L = width, layers
    k = iter(jax.random.split(key, 8))

    def normal(shape, std):
        return std * jax.random.normal(next(k), shape, dtype)

    zeros, ones = (lambda *s: jnp.zeros(s, dtype)), (lambda *s: jnp.ones(s, dtype))
    out_std = w_init / math.sqrt(2 * L)
    return {
        "read_in": normal((D + 1, E), w_init), "read_in_bias": zeros(E),
        "positions": normal((max_tokens, E), w_init),
        "blocks": {"ln1_scale": ones(L, E), "ln1_bias": zeros(L, E), "ln2_scale": ones(L, E), "ln2_bias": zeros(L, E),
                   "qkv": normal((L, E, 3, H, E // H), w_init), "qkv_bias": zeros(L, 3, H, E // H),
                   "proj": normal((L, H, E // H, E), out_std), "proj_bias": zeros(L, E),
                   "mlp_in": normal((L, E, 4 * E), w_init), "mlp_in_bias": zeros(L, 4 * E),
                   "mlp_out": normal((L, 4 * E, E), out_std), "mlp_out_bias": zeros(L, E)},
        "ln_scale": ones(E), "ln_bias": zeros(E),
        "read_out": normal((E,), w_init), "read_out_bias": zeros(),
    }


def linreg_tokens(x: jax.Array, y: jax.Array, x_q: jax.Array) -> jax.Array:
    """The token sequence of prompts: (x_1, y_1, …, x_N, y_N, x_q) as [x; 0] and [0; y] rows.

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
    Returns:
        (..., 2N + 1, D + 1) tokens.
    """
    x, y, x_q = jnp.asarray(x), jnp.asarray(y), jnp.asarray(x_q)
    zeros = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
    x_tok = jnp.concatenate([x, zeros], axis=-1)                                 # (..., N, D+1)
    y_tok = jnp.concatenate([jnp.zeros_like(x), y[..., None]], axis=-1)          # (..., N, D+1)
    pairs = jnp.stack([x_tok, y_tok], axis=-2).reshape(x.shape[:-2] + (2 * x.shape[-2], x.shape[-1] + 1))
    q_tok = jnp.concatenate([x_q, jnp.zeros(x_q.shape[:-1] + (1,), x.dtype)], axis=-1)[..., None, :]
    return jnp.concatenate([pairs, q_tok], axis=-2)


def _layer_norm(h, scale, bias):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
    return (h - mean) / jnp.sqrt(var + LN_EPS) * scale + bias


def _gelu(u):
    return 0.5 * u * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))  # GPT-2's tanh form


def _read_in(params, Z):
    T = Z.shape[-2]
    h = Z @ params["read_in"] + params["read_in_bias"]
    if params["positions"].shape[0]:
        if T > params["positions"].shape[0]:
            raise ValueError(f"a prompt of {T} tokens is longer than the positional embeddings "
                             f"({params['positions'].shape[0]}): init with max_tokens ≥ {T}")
        h = h + params["positions"][:T]
    return h


def outputs(params: dict, Z: jax.Array) -> jax.Array:
    """Every token's read-out, all positions at once.

    Args:
        params: one model's params (:func:`init_transformer`).
        Z: (..., T, D + 1) tokens (:func:`linreg_tokens`).
    Returns:
        (..., T) read-outs; position 2n (0-based) predicts y_{n+1} from x_1..x_{n+1} and the labels before it, the
        last position predicts y_q.
    """
    h = _read_in(params, Z)
    T = h.shape[-2]
    b = params["blocks"]
    dh = b["qkv"].shape[-1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    for layer in range(b["qkv"].shape[0]):
        a = _layer_norm(h, b["ln1_scale"][layer], b["ln1_bias"][layer])
        qkv = jnp.einsum("...te,eihc->...tihc", a, b["qkv"][layer]) + b["qkv_bias"][layer]  # (..., T, 3, H, dh)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        scores = jnp.einsum("...thc,...shc->...hts", q, k) / math.sqrt(dh)
        scores = jnp.where(causal, scores, -jnp.inf)
        mixed = jnp.einsum("...hts,...shc->...thc", jax.nn.softmax(scores, axis=-1), v)
        h = h + jnp.einsum("...thc,hce->...te", mixed, b["proj"][layer]) + b["proj_bias"][layer]
        a = _layer_norm(h, b["ln2_scale"][layer], b["ln2_bias"][layer])
        h = h + _gelu(a @ b["mlp_in"][layer] + b["mlp_in_bias"][layer]) @ b["mlp_out"][layer] + b["mlp_out_bias"][layer]
    h = _layer_norm(h, params["ln_scale"], params["ln_bias"])
    return h @ params["read_out"] + params["read_out_bias"]


def naive_outputs(params: dict, Z: jax.Array) -> jax.Array:
    """The reference of :func:`outputs` for one prompt: a loop over tokens, heads and the tokens each attends to.

    Args:
        params: one model's params.
        Z: (T, D + 1) tokens of ONE prompt.
    Returns:
        (T,) read-outs.
    """
    T = Z.shape[0]
    b = params["blocks"]
    E, heads, dh = b["qkv"].shape[1], b["qkv"].shape[3], b["qkv"].shape[4]

    def norm(u, scale, bias):  # one token's LayerNorm
        mean = jnp.sum(u) / E
        var = jnp.sum((u - mean) ** 2) / E
        return (u - mean) / jnp.sqrt(var + LN_EPS) * scale + bias

    rows = [Z[t] @ params["read_in"] + params["read_in_bias"] + (params["positions"][t] if params["positions"].shape[0]
                                                                 else 0.0) for t in range(T)]
    for layer in range(b["qkv"].shape[0]):
        normed = [norm(r, b["ln1_scale"][layer], b["ln1_bias"][layer]) for r in rows]
        # q, k, v of token t and head h: its own (E,) × (E, dh) products
        qkv = [[[normed[t] @ b["qkv"][layer][:, i, h] + b["qkv_bias"][layer][i, h] for h in range(heads)]
                for i in range(3)] for t in range(T)]
        new = []
        for t in range(T):
            attended = jnp.zeros(E, Z.dtype)
            for h in range(heads):
                scores = [jnp.dot(qkv[t][0][h], qkv[s][1][h]) / math.sqrt(dh) for s in range(t + 1)]
                top = jnp.max(jnp.stack(scores))
                weights = [jnp.exp(sc - top) for sc in scores]
                head_out = sum(w * qkv[s][2][h] for s, w in enumerate(weights)) / sum(weights)
                attended = attended + head_out @ b["proj"][layer][h]
            r = rows[t] + attended + b["proj_bias"][layer]
            u = norm(r, b["ln2_scale"][layer], b["ln2_bias"][layer]) @ b["mlp_in"][layer] + b["mlp_in_bias"][layer]
            new.append(r + _gelu(u) @ b["mlp_out"][layer] + b["mlp_out_bias"][layer])
        rows = new
    return jnp.stack([norm(r, params["ln_scale"], params["ln_bias"]) @ params["read_out"] + params["read_out_bias"]
                      for r in rows])


def predict(params: dict, prompts) -> jax.Array:
    """ŷ_q of linreg-layout prompts (:class:`iclab.tasks.linreg.Prompts`, or any with x, y, x_q).

    Args:
        params: one model's params.
        prompts: P prompts: x (P, N, D), y (P, N), x_q (P, D).
    Returns:
        (P,) predictions: the read-out at the query's token.
    """
    return outputs(params, linreg_tokens(prompts.x, prompts.y, prompts.x_q))[..., -1]


def _init_linreg(key, *, D, H, w_init, R=1, **sizes):
    """The registered family's init: GPT-2's (w_init is its weights' std), H heads, 2 blocks, width 16 H."""
    return init_transformer(key, D=D, H=H, w_init=w_init, R=R, **{"layers": 2, "width": 16 * H, **sizes})


FAMILY = register_model(ModelFamily(
    "transformer", "linreg", _init_linreg, predict,
    description="GPT-2-style transformer (pre-LayerNorm causal softmax attention + MLP) over (x, y) tokens, "
                "read out at the query (Garg et al. 2022)"))
