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
prediction of every label (Garg et al.'s loss: :func:`predict_every_label` against :func:`every_label_targets`, the
family object :data:`EVERY_LABEL` for :func:`iclab.engines.train_family`) or of the query's alone.

:func:`outputs` computes every position at once (batched matrix products with a causal mask);
:func:`naive_outputs` is its reference: a plain loop over tokens and heads, each token attending to the ones
before it by an explicit softmax. tests/models/test_transformer.py compares outputs and gradients in float64.

Every iclab task is read the same way (:func:`prompt_layout` says where each part lies, 0-based): an input x_n is
the token [x_n; 0], its label the next token [0; y_n], the query [x_q; 0] comes last, and the read-out at a
token predicts the label that follows it, so the causal mask lets no read-out see the label it predicts. One
registered family per task, each reading that task's own batch and declaring its own target
(:attr:`iclab.models.ModelFamily.target`), so that :func:`iclab.engines.train_family` trains any of them by one
call; the existing ``task == "linreg"`` of the linreg engines is kept:

- ``transformer`` (task ``linreg``): :class:`iclab.tasks.linreg.Prompts`, hence also the finite task pools of
  :mod:`iclab.tasks.pool` (the same prompts); tokens of width D + 1 (:func:`linreg_tokens`); target y_q.
- ``transformer_multitask`` (task ``multitask``): :class:`iclab.tasks.multitask.MultitaskPrompts` (gating,
  Sec 5.1), K equal blocks of n/K samples (K read from ``tasks``; Def 1's prompts are K = n blocks of one), block
  k followed by a delimiter token whose own channel marks it, [0_d; 0; e_k], as eq 19's delimiters d_k =
  [0; 0; c̄_k] with one-hot contexts; tokens of width d + 1 + K (:func:`multitask_tokens`); target y_{n+1}.
- ``transformer_drift`` (task ``drift``): :class:`iclab.tasks.drift.DriftPrompts` (eqs 2-4), the n labelled
  pairs and the query x_{n+1} as linreg's tokens (:func:`drift_tokens`); target y_{n+1}, the query's label
  alone, as the drift experiments train their GLA (an online predictor of every label is the read-out at every
  input token, ``outputs(params, Z)[..., prompt_layout(n).inputs]``).
- ``transformer_multitask_regression`` (task ``multitask_regression``):
  :class:`iclab.tasks.multitask_regression.MultitaskPrompts` (mhsa, eq 2.4), the columns of X and Y as tokens
  [x_l; 0_{d_y}] and [0_d; y_l] (:func:`multitask_regression_tokens`), read out by a (E, d_y) map; target the
  vector y_q = Gᵀq (the training loss is the mean over the P · d_y entries of (ŷ − y_q)²).

Params (one model; the L blocks stacked on a leading axis): ``read_in`` (D+1, E) and ``read_in_bias`` (E,),
``positions`` (T_max, E) (T_max = 0: none), ``blocks`` {``ln1_scale``, ``ln1_bias``, ``ln2_scale``,
``ln2_bias`` (L, E), ``qkv`` (L, E, 3, H, E/H), ``qkv_bias`` (L, 3, H, E/H), ``proj`` (L, H, E/H, E),
``proj_bias`` (L, E),
``mlp_in`` (L, E, 4E), ``mlp_in_bias`` (L, 4E), ``mlp_out`` (L, 4E, E), ``mlp_out_bias`` (L, E)},
``ln_scale``, ``ln_bias`` (E,), ``read_out`` (E,) and ``read_out_bias`` () (or (E, d_y) and (d_y,) for d_y
outputs per token). The heads are read from the shapes.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from iclab.models._family import ModelFamily, register_model

__all__ = ["EVERY_LABEL", "FAMILY", "FAMILIES", "Layout", "TransformerSettings", "drift_tokens", "every_label_targets", "init_transformer",
           "linreg_tokens", "multitask_regression_tokens", "multitask_tokens", "naive_outputs", "outputs", "predict",
           "predict_drift", "predict_every_label", "predict_multitask",
           "predict_multitask_regression", "prompt_layout"]

LN_EPS = 1e-5  # GPT-2's LayerNorm epsilon


def init_transformer(key: jax.Array, *, D: int, H: int = 2, layers: int = 2, width: int = 32, w_init: float = 0.02,
                     max_tokens: int = 0, out_dim: int | None = None, R: int = 1, dtype=jnp.float64) -> dict:
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
        out_dim: None for one read-out per token (``read_out`` (E,)), else d_y ≥ 1 of them (``read_out`` (E, d_y)).
        R: ignored (the linreg families' init keywords).
        dtype: the params' dtype.
    Returns:
        The params of one model (module docstring).
    """
    del R
    if layers < 1 or H < 1 or width < 1 or width % H:
        raise ValueError(f"width {width} must be a positive multiple of H = {H}, and layers ≥ 1 (got {layers})")
    if out_dim is not None and out_dim < 1:
        raise ValueError(f"out_dim must be None or ≥ 1 (got {out_dim})")
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
        "read_out": normal((E,) if out_dim is None else (E, out_dim), w_init),
        "read_out_bias": zeros() if out_dim is None else zeros(out_dim),
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
        (..., T) read-outs ((..., T, d_y) with a (E, d_y) read-out); position 2n (0-based) predicts y_{n+1} from
        x_1..x_{n+1} and the labels before it, the last position predicts y_q (:func:`prompt_layout`).
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
        (T,) read-outs ((T, d_y) with a (E, d_y) read-out).
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


class Layout(NamedTuple):
    """Where each part of a prompt lies in its token sequence (0-based positions, static).

    Attributes:
        inputs: (n,) the token of x_n, whose read-out predicts y_n (an online prediction of every label).
        labels: (n,) the token of y_n, right after x_n's.
        markers: (K,) the delimiter after each of K blocks (multitask), or (0,).
        query: the query's token, the last; its read-out predicts the target.
        length: T, the number of tokens.
    """

    inputs: np.ndarray
    labels: np.ndarray
    markers: np.ndarray
    query: int
    length: int


def prompt_layout(n: int, blocks: int = 0) -> Layout:
    """The token positions of a prompt of n labelled pairs: x_1, y_1, …, x_n, y_n, x_q, with, for ``blocks`` = K
    > 0, K equal blocks of n/K pairs each followed by its delimiter (T = 2n + K + 1).

    Args:
        n: labelled pairs (≥ 0).
        blocks: K ≥ 1 delimited blocks dividing n, or 0 for none.
    Returns:
        The :class:`Layout`.
    """
    if n < 0 or blocks < 0 or (blocks and n % blocks):
        raise ValueError(f"blocks must be 0 or a positive divisor of n = {n} (got {blocks})")
    size = n // blocks if blocks else n
    inputs, markers, pos = [], [], 0
    for j in range(n):
        inputs.append(pos)
        pos += 2
        if blocks and (j + 1) % size == 0:
            markers.append(pos)
            pos += 1
    inputs = np.asarray(inputs, dtype=int)
    return Layout(inputs, inputs + 1, np.asarray(markers, dtype=int), pos, pos + 1)


def _place(layout: Layout, channels: int, x, labels, x_q, markers=None) -> jax.Array:
    """Tokens of ``layout``: x (..., n, a) in channels [0, a) of the inputs, labels (..., n, b) in channels [a, a + b)
    of the labels, x_q (..., a) at the query, and a one-hot marker in channel a + b + k of delimiter k."""
    a, b = x.shape[-1], labels.shape[-1]
    Z = jnp.zeros(x.shape[:-2] + (layout.length, channels), x.dtype)
    Z = Z.at[..., layout.inputs, :a].set(x).at[..., layout.labels, a:a + b].set(labels)
    Z = Z.at[..., layout.query, :a].set(x_q)
    if len(layout.markers):
        Z = Z.at[..., layout.markers, a + b + np.arange(len(layout.markers))].set(1.0)
    return Z


def multitask_tokens(x: jax.Array, y: jax.Array, x_query: jax.Array, K: int) -> jax.Array:
    """The tokens of K-block prompts (gating, Sec 5.1): [x_n; 0; 0_K], [0_d; y_n; 0_K], after block k the delimiter
    [0_d; 0; e_k], and the query [x_q; 0; 0_K] (:func:`prompt_layout` with ``blocks=K``).

    Args:
        x: (..., n, d) context inputs, the blocks in order, n/K each.
        y: (..., n) context labels.
        x_query: (..., d) query inputs.
        K: the blocks (dividing n).
    Returns:
        (..., 2n + K + 1, d + 1 + K) tokens.
    """
    x, y, x_query = jnp.asarray(x), jnp.asarray(y), jnp.asarray(x_query)
    layout = prompt_layout(x.shape[-2], K)
    return _place(layout, x.shape[-1] + 1 + K, x, y[..., None], x_query)


def drift_tokens(prompts) -> jax.Array:
    """The tokens of drifting-task prompts (:class:`iclab.tasks.drift.DriftPrompts`): the n labelled pairs and the
    query x_{n+1} as :func:`linreg_tokens`; y_{n+1} is not in them.

    Args:
        prompts: x (..., n+1, d), y (..., n+1).
    Returns:
        (..., 2n + 1, d + 1) tokens.
    """
    x, y = jnp.asarray(prompts.x), jnp.asarray(prompts.y)
    return linreg_tokens(x[..., :-1, :], y[..., :-1], x[..., -1, :])


def multitask_regression_tokens(X: jax.Array, Y: jax.Array, q: jax.Array) -> jax.Array:
    """The tokens of mhsa prompts (eq 2.4, tokens as columns there): [x_l; 0_{d_y}], [0_d; y_l], …, [q; 0_{d_y}].

    Args:
        X: (..., d, L) context covariates (columns).
        Y: (..., d_y, L) context responses.
        q: (..., d) queries.
    Returns:
        (..., 2L + 1, d + d_y) tokens.
    """
    X, Y, q = jnp.asarray(X), jnp.asarray(Y), jnp.asarray(q)
    layout = prompt_layout(X.shape[-1])
    return _place(layout, X.shape[-2] + Y.shape[-2], jnp.swapaxes(X, -1, -2), jnp.swapaxes(Y, -1, -2), q)


def _at_query(params: dict, Z: jax.Array) -> jax.Array:
    out = outputs(params, Z)
    return out[..., -1] if out.ndim == Z.ndim - 1 else out[..., -1, :]


def predict(params: dict, prompts) -> jax.Array:
    """ŷ_q of linreg-layout prompts (:class:`iclab.tasks.linreg.Prompts`, or any with x, y, x_q).

    Args:
        params: one model's params.
        prompts: P prompts: x (P, N, D), y (P, N), x_q (P, D).
    Returns:
        (P,) predictions: the read-out at the query's token.
    """
    return _at_query(params, linreg_tokens(prompts.x, prompts.y, prompts.x_q))


def predict_every_label(params: dict, prompts) -> jax.Array:
    """Every label's prediction from the tokens before it: ŷ_n, the read-out at x_n's token (it sees x_1..x_n and
    y_1..y_{n−1}), n = 1..N, and ŷ_q at the query's (Garg et al. 2022's training loss averages their errors).

    Args:
        params: one model's params.
        prompts: P prompts: x (P, N, D), y (P, N), x_q (P, D).
    Returns:
        (P, N + 1) predictions of (y_1, …, y_N, y_q) (:func:`every_label_targets`); the last column is
        :func:`predict`'s.
    """
    out = outputs(params, linreg_tokens(prompts.x, prompts.y, prompts.x_q))
    return out[..., np.append(prompt_layout(prompts.x.shape[-2]).inputs, -1)]


def every_label_targets(prompts) -> jax.Array:
    """The labels :func:`predict_every_label` predicts: (y_1, …, y_N, y_q).

    Args:
        prompts: P prompts: y (P, N), y_q (P,).
    Returns:
        (P, N + 1) labels.
    """
    return jnp.concatenate([prompts.y, prompts.y_q[..., None]], axis=-1)


def predict_multitask(params: dict, prompts) -> jax.Array:
    """ŷ_{n+1} of K-block prompts (:class:`iclab.tasks.multitask.MultitaskPrompts`; K = ``tasks.shape[-2]``).

    Args:
        params: one model's params (token width d + 1 + K).
        prompts: x (P, n, d), y (P, n), x_query (P, d), tasks (P, K, d).
    Returns:
        (P,) predictions: the read-out at the query's token.
    """
    return _at_query(params, multitask_tokens(prompts.x, prompts.y, prompts.x_query, prompts.tasks.shape[-2]))


def predict_drift(params: dict, prompts) -> jax.Array:
    """ŷ_{n+1} of drifting-task prompts (:class:`iclab.tasks.drift.DriftPrompts`).

    Args:
        params: one model's params (token width d + 1).
        prompts: x (P, n+1, d), y (P, n+1).
    Returns:
        (P,) predictions: the read-out at x_{n+1}'s token.
    """
    return _at_query(params, drift_tokens(prompts))


def predict_multitask_regression(params: dict, prompts) -> jax.Array:
    """ŷ_q of mhsa prompts (:class:`iclab.tasks.multitask_regression.MultitaskPrompts`).

    Args:
        params: one model's params (token width d + d_y, a (E, d_y) read-out).
        prompts: X (P, d, L), Y (P, d_y, L), q (P, d).
    Returns:
        (P, d_y) predictions: the read-outs at the query's token.
    """
    return _at_query(params, multitask_regression_tokens(prompts.X, prompts.Y, prompts.q))


class TransformerSettings(BaseModel):
    """The transformer's settings an experiment exposes, declared once: its architecture and init
    (:func:`init_transformer`) and the labels it trains on.

    An experiment's config holds them whole, ``transformer: TransformerSettings = nested(TransformerSettings,
    "...", layers=setting(2), ...)`` (:func:`iclab.experiments.nested`), so that every experiment training this
    family names, bounds and describes them alike (``transformer.layers``, ...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(2, description="pre-LN blocks (one block cannot pair x_i with y_i, a token apart)", ge=1,
                        le=64)
    width: int = Field(32, description="residual width E (a multiple of heads)", ge=1, le=4096)
    heads: int = Field(2, description="attention heads per block", ge=1, le=64)
    w_init: float = Field(0.02, description="init std of every weight (GPT-2's 0.02)", gt=0, le=10)
    positions: bool = Field(True, description="learned positional embeddings (GPT-2's; without them the pre-LayerNorm "
                            "reads a token's direction only and cannot pair x_i with y_i)")
    loss: Literal["every_label", "query"] = Field(
        "every_label", description="the training loss: the mean squared error of every label predicted from the "
        "tokens before it (Garg et al.; Raventós et al.), or of the query's alone")

    @model_validator(mode="after")
    def _heads_divide_width(self):
        if self.width % self.heads:
            raise ValueError(f"width must be a multiple of heads = {self.heads} (got {self.width})")
        return self

    def sizes(self, *, tokens: int) -> dict[str, Any]:
        """The keyword arguments of the family's init (:func:`init_transformer`) these settings give.

        Args:
            tokens: a prompt's token count (2N + 1 for N labelled pairs and the query).
        Returns:
            {"H", "layers", "width", "w_init", "max_tokens"}: max_tokens = ``tokens`` with learned positions, 0
            without.
        """
        return dict(H=self.heads, layers=self.layers, width=self.width, w_init=self.w_init,
                    max_tokens=tokens if self.positions else 0)

    def activation_floats(self, *, tokens: int, token_width: int) -> int:
        """Numbers one prompt's forward pass keeps (an upper estimate for memory): the T tokens of width
        ``token_width`` and, per block, ~12E per token (the 4E MLP, q, k, v, the residuals) and the H·T
        attention weights per token.

        Args:
            tokens: the prompt's token count T.
            token_width: the width of a token before the read-in (D + 1 for linreg prompts).
        Returns:
            T·token_width + T·layers·(12E + H·T).
        """
        T, E = tokens, self.width
        return T * token_width + T * self.layers * (12 * E + self.heads * T)


def _defaults(H: int, sizes: dict[str, Any]) -> dict[str, Any]:
    return {"layers": 2, "width": 16 * H, **sizes}


def _init_linreg(key, *, D, H, w_init, R=1, **sizes):
    """The registered family's init: GPT-2's (w_init is its weights' std), H heads, 2 blocks, width 16 H."""
    return init_transformer(key, D=D, H=H, w_init=w_init, R=R, **_defaults(H, sizes))


def _init_multitask(key, *, d, K, H=2, w_init=0.02, **sizes):
    """Tokens of width d + 1 + K (:func:`multitask_tokens`); otherwise as the linreg family."""
    return init_transformer(key, D=d + K, H=H, w_init=w_init, **_defaults(H, sizes))


def _init_drift(key, *, d, H=2, w_init=0.02, **sizes):
    """Tokens of width d + 1 (:func:`drift_tokens`); otherwise as the linreg family."""
    return init_transformer(key, D=d, H=H, w_init=w_init, **_defaults(H, sizes))


def _init_multitask_regression(key, *, d, d_y, H=2, w_init=0.02, **sizes):
    """Tokens of width d + d_y (:func:`multitask_regression_tokens`; D + 1 = d + d_y) and d_y read-outs."""
    return init_transformer(key, D=d + d_y - 1, H=H, w_init=w_init, out_dim=d_y, **_defaults(H, sizes))


FAMILY = register_model(ModelFamily(
    "transformer", "linreg", _init_linreg, predict,
    description="GPT-2-style transformer (pre-LayerNorm causal softmax attention + MLP) over (x, y) tokens, "
                "read out at the query (Garg et al. 2022)"))

#: The transformer family of each task, by task name (module docstring).
FAMILIES: dict[str, ModelFamily] = {"linreg": FAMILY}
for _family in (
    ModelFamily("transformer_multitask", "multitask", _init_multitask, predict_multitask,
                target=lambda batch: batch.y_query,
                description="the transformer on K-block prompts with one-hot delimiters (gating Sec 5.1; "
                            "init(key, d=, K=, ...)); ŷ_{n+1}"),
    ModelFamily("transformer_drift", "drift", _init_drift, predict_drift, target=lambda batch: batch.y[..., -1],
                description="the transformer on drifting-task prompts (drift eqs 2-4; init(key, d=, ...)); ŷ_{n+1}"),
    ModelFamily("transformer_multitask_regression", "multitask_regression", _init_multitask_regression,
                predict_multitask_regression,
                description="the transformer on multi-task regression prompts (mhsa eq 2.4; init(key, d=, d_y=, "
                            "...)); ŷ_q ∈ R^{d_y}"),
):
    FAMILIES[_family.task] = register_model(_family)
del _family

#: The linreg transformer trained on every label (Garg et al. 2022's loss): the same init and params as
#: ``transformer``, its prediction :func:`predict_every_label` (P, N + 1) and its target :func:`every_label_targets`,
#: so that :func:`iclab.engines.train_family` (which takes a family object as well as a name) trains it on
#: (1/(P(N+1))) Σ_p Σ_n (ŷ_{p,n} − y_{p,n})²; the trained params are ``transformer``'s (its ``predict`` reads them
#: out at the query). Not registered: the linreg engines read a (P,) prediction of y_q from a registered family.
EVERY_LABEL = ModelFamily("transformer_every_label", "linreg", _init_linreg, predict_every_label,
                          target=every_label_targets,
                          description="the linreg transformer's prediction of every label from the tokens before "
                                      "it (Garg et al. 2022's training loss); ŷ ∈ R^{N+1}")
