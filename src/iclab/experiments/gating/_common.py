"""Shared pieces of the gating experiments: configs, the joint training of a grid of GLA models, their
evaluation against the closed forms of ``iclab.theory.wpgd``, and the restricted models on the exact risk.

Models are the registered GLA families of :mod:`iclab.models.gla` (``linatt``, ``gla``, ``gla_wo``,
``gla_vector``, ``gla_multilayer``): a family's task says which tokens it reads (delimiter prompts of eq 19,
or plain [x; y] tokens). What is particular to these figures (the closed form a kind is compared with,
its label and colour) is a :class:`Kind`.

Joint training (our implementation of App B.1's one model per n̄): every model of a seed — each kind, each panel (r₁, r₂) and each n̄ — is a member
of ONE :func:`iclab.engines.train_members` run on the sum of the models' batch losses; Adam acts
elementwise, so each model follows exactly the updates it would get alone. Every member of a seed sees
the same step's random numbers: one draw of inputs x and task normals G at the largest n̄ serves every
panel (β = L_panel G; each panel's draw depends only on the step's key and its factor) and every n̄ (the
last n̄ samples of each block). Member m's init key is fold_in(fold_in(key_s, INIT_STREAM), id_m) with
id_m a function of (kind, panel, restart, n̄) only (:func:`member_id`), so a subset of the grid trained
alone follows the same trajectory. Two layouts of the n̄ axis give the same models: ``separate`` builds
one token tensor per n̄; ``padded`` one tensor at the largest n̄, vmapped over n̄ with a token mask per n̄
(masked tokens contribute nothing and gate 1, so a model sees exactly its shorter prompt). The compiled
kernels (the ``native`` backend, a run option: :func:`iclab.engines.backend`) read one tensor at the largest n̄, each n̄ at its own token positions; and as the
panels' factors share the rows of the context tasks β_1..β_K (only the query's task depends on (r₁, r₂)), every
panel has the same tokens: the sampler then draws one token tensor that every panel's models read, each
compared with its own panel's targets.

Evaluation: the MSE of a model on N fresh prompts has a relative standard error of about √(2/N), too coarse
for a 5 % comparison at affordable N. Each model is therefore evaluated beside the optimal predictor of the
closed form it is compared with (eq 24 for LinAtt, eq 22 for GLA, Thm 5 for GLA-vector, all gates ½ for
GLA-wo), ŷ_ref = xᵀ P_ref Xᵀ(ω_ref ⊙ y), on the SAME prompts, and its risk is estimated by
:func:`iclab.experiments._analysis.control_variate_risk`,

    err ≈ E_ref + mean[(ŷ_model − y)² − (ŷ_ref − y)²],

unbiased because E[(ŷ_ref − y)²] = E_ref exactly (eq 37 under Defs 1-2); the difference has a small variance
when the trained model predicts nearly what the optimum does, and a large one when it does not. The raw
Monte-Carlo MSEs are kept, and the reference predictors' raw MSEs are checked against E_ref (a test of the
sampler and the closed forms that involves no training).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import field_validator

from iclab import baselines
from iclab.engines import Members, backend, population, seed_keys, train_members
from iclab.engines.joint import member_keys
from iclab.experiments._analysis import control_variate_risk
from iclab.experiments._config import ExperimentConfig, TrainingConfig, param
from iclab.experiments._memory import FLOAT64, Term, itemsize, records, total
from iclab.experiments._plot import COLORS
from iclab.models import get_model, model_families
from iclab.models import gla
from iclab.progress import task
from iclab.tasks import multitask as mt
from iclab.tasks import standard_normal
from iclab.theory import wpgd as theory

PAPER = "gating"
K = 2  # tasks per prompt in every experiment of the paper (App B.1)
#: Fig 1 panels (a)-(d): (r₁, r₂).
PANELS = ((0.0, 1.0), (0.2, 0.8), (0.5, 0.5), (0.8, 0.2))
PANEL_NAMES = ("a", "b", "c", "d")
#: One colour per model across the gating figures (the paper's: blue, red, green, cyan; L-layer in Fig 2).
COLOR = {"linatt": COLORS[0], "gla": COLORS[3], "gla_wo": COLORS[2], "gla_vector": COLORS[9],
         "eq24": COLORS[0], "eq17": "black", "gla_1": COLORS[0], "gla_2": COLORS[3], "gla_3": COLORS[2]}
#: Closed form whose optimal predictor is each reference class (see ``theory_refs``).
REF_CLASSES = ("att", "scalar", "vector", "half")
#: The model families the gating experiments can train: those that read multitask tokens.
TASKS = (gla.DELIMITED, gla.PLAIN)
#: fold_in streams of a seed's key: member inits, training batches, test prompts, restricted-model inits, and
#: the held-out prompts of the algorithm match and the Bayes risk (no training stream is touched).
INIT_STREAM, DATA_STREAM, EVAL_STREAM, RESTRICTED_STREAM, MATCH_STREAM = 10, 20, 30, 100, 40
#: Bounds of the member-id encoding (``member_id``).
MAX_RESTARTS, MAX_N_BAR = 128, 1000


@dataclass(frozen=True)
class Kind:
    """One trained model kind of a gating run.

    Attributes:
        family: registered model family (task ``multitask_delimited`` or ``multitask_plain``).
        ref: closed-form class of its control variate (one of ``REF_CLASSES``).
        panels: indices into the run's panels where the kind is trained; a repeated index is a restart
            (another initialisation on the same data stream).
        code: the kind's part of its members' ids (distinct per kind within an experiment).
        options: extra init keywords of the family (e.g. ``layers``).
    """

    family: str
    ref: str
    panels: tuple[int, ...]
    code: int
    options: dict[str, Any] = field(default_factory=dict)


def family_names() -> list[str]:
    """Names of the registered families whose task is one of ``TASKS`` (the kinds a config may list)."""
    return sorted(name for t in TASKS for name in model_families(t))


def token_width(family: str, d: int, p: int) -> int:
    """Token width D of the prompts a family reads: d + 1 + p with delimiters, d + 1 without."""
    return d + 1 + (p if get_model(family).task == gla.DELIMITED else 0)


def _fmt(family: str) -> str:
    return "delim" if get_model(family).task == gla.DELIMITED else "plain"


class TaskConfig(ExperimentConfig):
    """The multitask setting of App B.1: K = 2 independent tasks of n̄ samples each, Σ = I."""

    d: int = param(10, "input dimension d", paper=10, ge=1, le=64)
    p: int = param(5, "context (delimiter) dimension p", paper=5, ge=1, le=64)
    sigma2: float = param(0.0, "label-noise variance σ²", paper=0.0, ge=0, le=100)
    n_bars: list[int] = param([0, 1, 2, 5, 10, 15, 20, 30, 40, 50], "samples per task n̄ (one model per n̄)",
                              paper="0..50", paper_note="'vary n̄ from 0 to 50'; the grid is unspecified")
    query_context: Literal["c0", "zero"] = param(
        "c0", "context part of the query token: c̄_0 (as data tokens) or 0", paper=None,
        paper_note="unspecified; the Thm 4 proof needs query gate 1, i.e. c̄_0")

    @field_validator("n_bars")
    @classmethod
    def _sorted(cls, value):
        if len(value) == 0 or any(v < 0 for v in value) or sorted(set(value)) != list(value):
            raise ValueError("n_bars must be a nonempty increasing list of distinct integers >= 0")
        if value[-1] < 1 or value[-1] > MAX_N_BAR:
            raise ValueError(f"n_bars must end with a value in 1..{MAX_N_BAR} (got {value[-1]})")
        return value

    def qc(self):
        """query_context as the index of ``delimiter_prompt`` (0) or None (zero context)."""
        return 0 if self.query_context == "c0" else None


class TrainConfig(TrainingConfig, TaskConfig):
    """Adam on fresh minibatches (App B.1), evaluation on fresh prompts."""

    steps: int = param(10_000, "optimiser steps", paper=10_000, ge=1, le=10_000_000)
    lr: float = param(1e-3, "learning rate (peak of the schedule)", paper=1e-3, gt=0, le=10)
    lr_schedule: Literal["constant", "cosine"] = param(
        "constant", "learning-rate schedule: constant, or cosine decay to 0", paper="constant",
        paper_note="unspecified; read as constant")
    optimizer: Literal["gd", "adam", "adamw"] = param("adam", "optimiser: plain GD, Adam, or AdamW", paper="adam")
    clip_norm: float = param(
        0.0, "clip each model's gradient to this Euclidean norm before the optimiser (0: no clipping)", paper=None,
        paper_note="unspecified; every model (kind, panel, n̄) of a seed is clipped by its own norm", ge=0, le=1e6)
    dtype: Literal["float32", "float64"] = param("float32", "training dtype (evaluation is float64)", paper=None,
                                                 paper_note="unspecified (PyTorch default float32)")
    batch: int = param(256, "prompts per step (a fresh batch every step)", paper=256, ge=1, le=100_000)
    init_std: float = param(0.1, "std of the Gaussian init of every weight entry", paper=None,
                            paper_note="unspecified", gt=0, le=10)
    init_identity: float = param(
        0.3, "identity added to the init of W_q, W_k, W_v (and init_identity·e_y to a head h)", paper=None,
        paper_note="unspecified; 0 is a plain Gaussian init, from which a sizeable share of runs stall in a "
        "rank-one saddle (value reads x, key reads y) — the paper's best-of-10 protocol absorbs that", ge=0, le=10)
    nbar_layout: Literal["separate", "padded"] = param(
        "separate", "how the models of different n̄ see their prompts: one token tensor per n̄ (arithmetic Σ_n̄ "
        "T(n̄), a traced graph per n̄), or one tensor at the largest n̄ with token masks, vmapped over n̄ "
        "(arithmetic G·T(n̄_max), one small graph); both give the same models", paper=None,
        paper_note="implementation choice: 'separate' in both presets (with the native backend, training reads "
        "each n̄ at its own length anyway and the layout only shapes the evaluation); in XLA on the "
        "10-value paper grid 'separate' does a fraction of the arithmetic of 'padded' (Σ_n̄ T(n̄) against "
        "G·T(n̄_max)); 'padded' traces one graph whatever the grid's length")
    n_eval: int = param(20_000, "fresh test prompts per seed and panel (shared by all models)", paper=None,
                        paper_note="unspecified", ge=100, le=10_000_000)
    eval_chunk: int = param(2048, "test prompts evaluated per jitted call (memory bound; at most n_eval are used)",
                            ge=1, le=1_000_000)
    record_every: int = param(250, "record the summed training loss every this many steps", ge=1, le=1_000_000)


def add_identity(params, scale: float, label: int):
    """W_{q,k,v} += scale·I and h += scale·e_label on an init (leading axes broadcast); of an L-layer model
    (a list) only the first layer.

    Layers 2..L keep the small Gaussian init, so the residual stack of eq 25 starts near the one-layer
    model: an identity in every layer makes each layer cubic in its input (z ↦ z + (zW_q)(ZW_k)ᵀ(ZW_v)) and
    the 3-layer output overflows float32 at the first step.

    Args:
        params: one model's params (a dict, or a list of layer dicts).
        scale: the identity's scale (0: unchanged).
        label: index d of the label coordinate (the head's e_label).
    Returns:
        params of the same structure.
    """
    if scale == 0:
        return params
    if isinstance(params, list):
        return [add_identity(params[0], scale, label)] + list(params[1:])
    out = dict(params)
    for name in ("Wq", "Wk", "Wv"):
        out[name] = params[name] + scale * jnp.eye(params[name].shape[-1], dtype=params[name].dtype)
    if "h" in params:
        out["h"] = params["h"].at[..., label].add(scale)
    return out


def sample_contexts(config: TaskConfig) -> jax.Array:
    """c̄_0..c̄_K ~ N(0, I_p) per seed, drawn once per run (App B.1: 'different choice of delimiters'). (S, K+1, p)."""
    return jnp.asarray(np.stack([np.random.default_rng([config.seed, s, 1]).standard_normal((K + 1, config.p))
                                 for s in range(config.seeds)]))


def token_masks(n_max: int, n_bars: Sequence[int], delimiters: bool) -> np.ndarray:
    """(G, T) token masks of the padded layout (block sizes (n_max, n_max)) for every n̄."""
    data_pos, _ = gla.token_layout([n_max] * K, delimiters)
    T = K * n_max + (K if delimiters else 0) + 1
    out = np.ones((len(n_bars), T))
    for g, nb in enumerate(n_bars):
        out[g, data_pos] = mt.padding_mask([n_max] * K, [nb] * K)
    return out


def sample_masks(n_max: int, n_bars: Sequence[int]) -> np.ndarray:
    """(G, K n_max) sample masks of the padded layout."""
    return np.stack([mt.padding_mask([n_max] * K, [nb] * K) for nb in n_bars])


def panel_factors(panels) -> np.ndarray:
    """(P, K+1, K+1) task factors L of App B.1 for each (r₁, r₂)."""
    return np.stack([mt.two_task_factor(r1=r1, r2=r2) for r1, r2 in panels])


def member_id(code: int, panel: int, restart: int, n_bar: int) -> int:
    """The id of one trained model: ((code·4 + panel)·MAX_RESTARTS + restart)·(MAX_N_BAR + 1) + n̄.

    A function of the kind's code, the panel's index in ``PANELS``, the restart and n̄ only, so the model's
    init key does not depend on which other models are trained beside it.
    """
    return ((code * len(PANELS) + panel) * MAX_RESTARTS + restart) * (MAX_N_BAR + 1) + n_bar


def member_ids(kind: Kind, panels, n_bars: Sequence[int]) -> np.ndarray:
    """(len(kind.panels), G) member ids of a kind (see ``member_id``)."""
    out = np.zeros((len(kind.panels), len(n_bars)), dtype=np.int64)
    for row, i in enumerate(kind.panels):
        restart = kind.panels[:row].count(i)
        if restart >= MAX_RESTARTS:
            raise ValueError(f"at most {MAX_RESTARTS} restarts per panel")
        panel = PANELS.index(tuple(float(v) for v in panels[i]))
        out[row] = [member_id(kind.code, panel, restart, nb) for nb in n_bars]
    return out


# --------------------------------------------------------------------------------------------
# Theory: curves and the optimal predictors used as control variates


def padded_correlation(n_max: int, n_bar: int, *, r1: float, r2: float):
    """(R, r) of App B.1 in the padded layout: entries of masked slots are 0. Returns (K n_max, K n_max), (K n_max,)."""
    m = mt.padding_mask([n_max] * K, [n_bar] * K)
    owner = np.repeat(np.arange(K), n_max)
    R = (owner[:, None] == owner[None, :]) * np.outer(m, m)
    r = np.array([r1, r2])[owner] * m
    return R.astype(float), r.astype(float)


def half_gate_weights(n: int) -> np.ndarray:
    """ω_j = 2^{−(n+1−j)}, j = 1..n: the WPGD weights of scalar gates all equal to ½ (eq 11), query gate included.

    Without delimiters every token is [x; y], mean zero, and the gate φ(w_gᵀz) has no bias; the trained GLA-wo
    settles at w_g ≈ 0, i.e. these weights (derived here, and observed in training).
    """
    return 0.5 ** (n - np.arange(n))


def theory_refs(d: int, sigma2: float, panels, n_bars, n_max: int) -> dict:
    """Closed-form curves and optimal predictors, per panel and n̄, in the padded layout.

    Returns a dict of numpy arrays (unnormalised risks):
        eq17, eq24 (P, G): L*_WPGD (eq 17) and L*_ATT (eq 24);
        E_<cls> (P, G), P_<cls> (P, G, d, d), omega_<cls> (P, G, K n_max) for cls in att (ω = 1, eq 24),
        scalar (eq 22, Thm 4), vector (Thm 5) and half (every gate ½, ``half_gate_weights``: GLA-wo's
        optimum among constant gates, derived here); n̄ = 0 gives ŷ = 0 and risk d + σ².
    """
    P_, G_ = len(panels), len(n_bars)
    out = {"eq17": np.zeros((P_, G_)), "eq24": np.zeros((P_, G_))}
    for cls in REF_CLASSES:
        out[f"E_{cls}"] = np.zeros((P_, G_))
        out[f"P_{cls}"] = np.zeros((P_, G_, d, d))
        out[f"omega_{cls}"] = np.zeros((P_, G_, K * n_max))
    I = np.eye(d)
    for i, (r1, r2) in enumerate(panels):
        for g, nb in enumerate(n_bars):
            if nb == 0:
                for key in ("eq17", "eq24") + tuple(f"E_{c}" for c in REF_CLASSES):
                    out[key][i, g] = d + sigma2
                continue
            R, r = theory.two_task_correlation(nb, r1=r1, r2=r2)
            out["eq17"][i, g] = theory.wpgd_optimal_risk_isotropic(d, R, r, sigma2)
            out["eq24"][i, g] = theory.linear_attention_risk_isotropic(d, R, r, sigma2)
            slots = np.nonzero(mt.padding_mask([n_max] * K, [nb] * K))[0]
            ones = np.ones(2 * nb)
            sols = {
                "att": (theory.optimal_preconditioner_given_weights(ones, I, R, r, sigma2), ones,
                        theory.linear_attention_risk(I, R, r, sigma2)),
            }
            half = half_gate_weights(2 * nb)
            sols["half"] = (theory.optimal_preconditioner_given_weights(half, I, R, r, sigma2), half,
                            theory.risk_given_weights(half, I, R, r, sigma2))
            for cls, fn in (("scalar", theory.scalar_gating_optimum), ("vector", theory.vector_gating_optimum)):
                opt = fn(I, R, r, sigma2, [nb] * K)
                sols[cls] = (opt.P, opt.omega, opt.risk)
            for cls, (P, om, E) in sols.items():
                out[f"P_{cls}"][i, g] = P
                out[f"omega_{cls}"][i, g, slots] = om
                out[f"E_{cls}"][i, g] = E
    return out


def wpgd_predict(P, omega, x, y, x_query):
    """ŷ = x_qᵀ P Xᵀ(ω ⊙ y) (eq 7). P: (d, d); omega: (n,); x: (..., n, d); y: (..., n); x_query: (..., d)."""
    return jnp.einsum("...i,ij,...nj,...n->...", x_query, P, x, omega * y)


# --------------------------------------------------------------------------------------------
# Joint training of unrestricted models


def _tokens(prompts, contexts, n_bar: int, n_max: int, config: TaskConfig, need: set) -> dict:
    """Tokens of the prompts cut to n̄ samples per block (the last n̄ of each block of the n_max draw)."""
    pr = mt.take_blocks(prompts, [n_max] * K, [n_bar] * K)
    sizes = [n_bar] * K
    out = {}
    if "delim" in need:
        out["delim"] = gla.delimiter_prompt(pr.x, pr.y, pr.x_query, sizes, contexts, query_context=config.qc())[0]
    if "plain" in need:
        out["plain"] = gla.delimiter_prompt(pr.x, pr.y, pr.x_query, sizes, None, delimiters=False)[0]
    return out


def _shared_tokens(prompts, contexts, config: TaskConfig, need: set) -> dict:
    """:func:`_tokens` at n̄ = n_max of prompts drawn for every panel with common random numbers, the same values.

    The panels share the inputs (``sample_blocks`` draws x without the factor), so the tokens are built from
    ``prompts.x[0]``, broadcast over the panels inside one concatenation per format. Through
    ``gla.delimiter_prompt`` XLA wrote each panel's copy of the gathered inputs first (41 MB a step in
    gating.fig1's paper preset, read again by both formats): this builds the step's tokens in one pass.

    Args:
        prompts: MultitaskPrompts with a leading panel axis, laid out with blocks (n_max, n_max).
        contexts: (K+1, p) delimiter contexts c̄_0..c̄_K.
        config: the task config (its query context).
        need: the token formats to build ("delim", "plain").
    Returns:
        format -> (P, B, T, D) tokens.
    """
    x, x_query = prompts.x[0], prompts.x_query[0]  # (B, n, d), (B, d): the same for every panel
    P, B, n = prompts.y.shape
    n_max, d, dt = n // K, x.shape[-1], x.dtype
    no_label = jnp.zeros((P, B, 1), dt)

    def rows(xs, ys, c):  # (B, r, d) inputs, (P, B, r) labels, (p,) context or None -> (P, B, r, D)
        parts = [jnp.broadcast_to(xs, (P,) + xs.shape), ys[..., None]]
        if c is not None:
            parts.append(jnp.broadcast_to(c, (P, B, xs.shape[1], c.shape[-1])))
        return jnp.concatenate(parts, axis=-1)

    out = {}
    if "delim" in need:
        contexts = jnp.asarray(contexts, dt)
        qc = config.qc()
        pieces = []
        for k in range(K):  # [Z_1; d_1; …; Z_K; d_K; z_query] (eq 19)
            block = slice(k * n_max, (k + 1) * n_max)
            pieces += [rows(x[:, block], prompts.y[..., block], contexts[0]),
                       rows(jnp.zeros((B, 1, d), dt), no_label, contexts[k + 1])]
        pieces.append(rows(x_query[:, None], no_label, jnp.zeros_like(contexts[0]) if qc is None else contexts[qc]))
        out["delim"] = jnp.concatenate(pieces, axis=-2)
    if "plain" in need:
        out["plain"] = jnp.concatenate([rows(x, prompts.y, None), rows(x_query[:, None], no_label, None)], axis=-2)
    return out


#: The families whose training loss the native kernel computes (one layer read at the query).
NATIVE_FAMILIES = ("linatt", "gla", "gla_wo", "gla_vector")


def native_positions(n_max: int, n_bars: Sequence[int], delimiters: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token positions of each n̄'s prompt inside the prompt drawn at n_max (the last n̄ samples of each block,
    the delimiters, the query): ``gla.subsequence_positions`` of the native kernel. Returns
    ((G, T_max), (G,))."""
    data_pos, delim_pos = gla.token_layout([n_max] * K, delimiters)
    T = K * n_max + (K if delimiters else 0) + 1
    keep = []
    for nb in n_bars:
        kept = data_pos[mt.padding_mask([n_max] * K, [nb] * K) > 0]
        keep.append(np.sort(np.concatenate([kept, delim_pos, [T - 1]])))
    return gla.subsequence_positions(keep)


def _members(config: TrainConfig, kind: Kind, panels, masks, n_max: int) -> Members:
    """The members of one kind: init through the registry, and the loss of the whole (panel, n̄) grid (prompts drawn
    at n_max)."""
    family = get_model(kind.family)
    fmt, d, dt = _fmt(kind.family), config.d, config.jnp_dtype()
    D = token_width(kind.family, d, config.p)
    sel = jnp.asarray(kind.panels)
    G = len(config.n_bars)

    def init(key, setting):
        params = family.init(key, D=D, std=config.init_std, dtype=dt, **kind.options)
        return add_identity(params, config.init_identity, d)

    if backend() == "native":
        positions, lengths = native_positions(n_max, config.n_bars, fmt == "delim")
        if kind.family in NATIVE_FAMILIES:
            def native_loss(params, batch, settings):  # one token tensor at n_max per format, (P, B, T_max, D)
                return gla.query_mse_grid(params, batch["tokens"][fmt], batch["y"], positions=positions,
                                                 lengths=lengths, rows=kind.panels, label=d)
        elif kind.family == "gla_multilayer":
            def native_loss(params, batch, settings):  # each model's whole loss in the host call
                blocked = fmt + "_blocked" in batch["tokens"]  # the prompts drawn on the kernels' layout
                return gla.multilayer_mse_grid(params, batch["tokens"][fmt + "_blocked" if blocked else fmt],
                                                      batch["y"], positions=positions, lengths=lengths,
                                                      rows=kind.panels, label=d, blocked=blocked)
        else:
            raise ValueError(f"the native backend trains the one-layer families {', '.join(NATIVE_FAMILIES)} and "
                             f"gla_multilayer (got {kind.family!r}); run with --backend xla")
        return Members(init, native_loss, member_ids(kind, panels, config.n_bars))

    def one(params, Z, y, mask=None):
        return jnp.mean((family.predict(params, Z, mask, label=d) - y) ** 2)

    def loss(params, batch, settings):
        if config.nbar_layout == "padded":  # params (P_kind, G, ...), tokens (P, B, T, D) shared by the n̄, masks (G, T)
            per_nbar = jax.vmap(one, in_axes=(0, None, None, 0))
            return jax.vmap(per_nbar, in_axes=(0, 0, 0, None))(params, batch["tokens"][fmt][sel], batch["y"][sel],
                                                                masks[fmt])
        return jnp.stack([jax.vmap(one)(jax.tree_util.tree_map(lambda a: a[:, g], params),
                                        batch["tokens"][g][fmt][sel], batch["y"][sel]) for g in range(G)], axis=1)

    return Members(init, loss, member_ids(kind, panels, config.n_bars))


#: Whether the native kernel's float32 batches of multi-layer models take their labels and blocked prompts from the
#: compiled pass of :func:`iclab.tasks.multitask.block_tokens` (gating.fig2's: the same bits as XLA's) instead of XLA's.
NATIVE_TOKENS = True


#: Whether the native kernel computes the multi-layer grids of every depth in one host call (``Members.joint``:
#: one queue of models on the threads, the prompts prepared once) rather than one call per depth; the same bits.
JOINT_GRIDS = True


def training_setup(config: TrainConfig, kinds: dict[str, Kind], panels, n_max: int | None = None):
    """The joint training's pieces: one Members group per kind, the step's sampler and the per-seed constants.

    Args:
        config, kinds, panels, n_max: as in :func:`train_models`.
    Returns:
        (groups name -> Members, sampler(key, aux) -> batch, aux {"contexts": (S, K+1, p)}).
    """
    dt = config.jnp_dtype()
    n_bars = config.n_bars
    n_max = max(n_bars) if n_max is None else n_max
    d = config.d
    L = panel_factors(panels)
    factors = jnp.asarray(L, dt)
    # The panels' context tasks β_1..β_K are the same rows of L (only the query's task correlates with them,
    # App B.1), so their tokens are the same: the native kernel reads one token tensor for every panel, the panels
    # differing only in the targets (a quarter of gating.fig1's token writes and reads).
    one_token_row = backend() == "native" and bool(np.all(L[:, :K] == L[:1, :K]))
    need = {_fmt(kind.family) for kind in kinds.values()}
    sigma = float(np.sqrt(config.sigma2))
    padded = config.nbar_layout == "padded"
    masks = {"delim": jnp.asarray(token_masks(n_max, n_bars, True), dt),
             "plain": jnp.asarray(token_masks(n_max, n_bars, False), dt)}

    # the native kernel's float32 batch of multi-layer models (gating.fig2): the labels and the delimiter prompts in
    # one compiled pass over the draw, on the layer kernels' blocked layout (read without a copy). The one-layer
    # families keep XLA's batch: the labels' sums there are XLA's FMAs in sequence (its fusion differs), not the
    # kernel's lanes, and the stored results are those bits.
    block = gla.LANES if (NATIVE_TOKENS and backend() == "native" and dt == jnp.float32 and need == {"delim"}
                               and all(kind.family == "gla_multilayer" for kind in kinds.values())) else 0

    def sampler(key, aux):
        if block:
            w = mt.block_draw(key, config.batch, [n_max] * K, d, dt)
            G = mt.task_normals(w, K, d)  # (w's one reader: XLA draws it in one pass)
            tasks = jax.vmap(lambda L: mt.block_tasks(G, L, K, d))(factors)
            tokens, y_query = mt.block_tokens(
                w, tasks, aux["contexts"], n_max=n_max, sigma=sigma, query_context=config.qc(), formats=tuple(need),
                token_rows=1 if one_token_row else None, block=block)
            return {"tokens": {"delim_blocked": tokens["delim"]}, "y": y_query}
        # one key for every panel: the panels share x and the task normals G
        pr = jax.vmap(lambda L: mt.sample_blocks(key, config.batch, [n_max] * K, L, None, sigma, d=d, dtype=dt))(factors)
        if padded or backend() == "native":  # one token tensor at n̄_max; smaller n̄ mask or skip samples
            cut = pr._replace(y=pr.y[:1]) if one_token_row else pr
            return {"tokens": _shared_tokens(cut, aux["contexts"], config, need), "y": pr.y_query}
        # one token tensor per n̄ (the cost is Σ_n̄ T(n̄), not G·T(n̄_max))
        return {"tokens": [_tokens(pr, aux["contexts"], nb, n_max, config, need) for nb in n_bars], "y": pr.y_query}

    groups = {name: _members(config, kind, panels, masks, n_max) for name, kind in kinds.items()}
    deep = [name for name, kind in kinds.items() if kind.family == "gla_multilayer" and _fmt(kind.family) == "delim"]
    if JOINT_GRIDS and backend() == "native" and len(deep) > 1:
        # the multi-layer grids (one per depth) in one host call: one queue of models on the threads
        positions, lengths = native_positions(n_max, config.n_bars, True)

        def joint(params, batch, settings):
            blocked = "delim_blocked" in batch["tokens"]
            grids = [(params[name], positions, lengths, kinds[name].panels) for name in params]
            losses = gla.multilayer_mse_grids(grids, batch["tokens"]["delim_blocked" if blocked else "delim"],
                                                     batch["y"], label=d, blocked=blocked)
            return dict(zip(params, losses))

        groups.update({name: groups[name]._replace(joint=joint) for name in deep})
    return groups, sampler, {"contexts": sample_contexts(config).astype(dt)}


def train_models(config: TrainConfig, kinds: dict[str, Kind], panels, reporter, label: str = "train",
                 n_max: int | None = None):
    """Trains one model per (kind, panel, n̄) for every seed, jointly (module docstring).

    Args:
        config: training setting.
        kinds: name -> Kind.
        panels: (P,) sequence of (r₁, r₂), each one of ``PANELS``.
        reporter: progress reporter (None: silent).
        label: the training task's label.
        n_max: the block size of the step's draw (default max(config.n_bars)); a shard of the n̄ grid
            gives the whole grid's, so that its models see the same batches as inside the grid.
    Returns:
        (Trajectory of the summed loss, dict name -> final params with leading (S, P_kind, G) axes, float64).
    """
    groups, sampler, aux = training_setup(config, kinds, panels, n_max)
    tr = train_members(groups, sampler, keys=seed_keys(config.seed, config.seeds), lr=config.schedule(),
                       n_steps=config.steps, optimizer=config.transformation(), clip_norm=config.clip_norm or None,
                       record_every=config.record_every, aux=aux, record_member_loss=False, init_stream=INIT_STREAM,
                       data_stream=DATA_STREAM, reporter=reporter, label=label)
    final = jax.tree_util.tree_map(lambda a: np.asarray(a, dtype=np.float64), tr.final_params)
    return tr._replace(final_params=None), final


# --------------------------------------------------------------------------------------------
# Memory estimates (``Experiment.memory``)


def prompt_tokens(family: str, n_bar: int) -> int:
    """Tokens T of a prompt of K blocks of n̄ samples: K·n̄ + 1 (the query), plus the K delimiters."""
    return K * n_bar + 1 + (K if _fmt(family) == "delim" else 0)


def _token_floats(config: TaskConfig, kind: Kind, n_bar: int, native: bool = False) -> float:
    """Numbers one model keeps per prompt of n̄ samples for its backward pass. XLA: a few (T, D) projections and
    outputs per layer, vector gates a (D, D) gate product per token, and each full layer of an L-layer model (the
    parallel form of :mod:`iclab.models.gla`) its (T, T) scores besides. The native kernels (``native``) compute
    loss and gradient together: nothing per prompt for one layer, a few (T, D) activations per full layer."""
    T, D = prompt_tokens(kind.family, n_bar), token_width(kind.family, config.d, config.p)
    layers = kind.options.get("layers", 1)
    if native:  # one-layer models: nothing per prompt (gla.query_mse_grid)
        return 4 * T * D * (layers - 1)
    per_layer = 8 * T * D + (T * D * D if kind.family == "gla_vector" else 0)
    return per_layer + (layers - 1) * (per_layer + 2 * T * T)


def training_memory(config: TrainConfig, kinds: dict[str, Kind], n_panels: int) -> Term:
    """Upper estimate of :func:`train_models`' memory: every seed's step at once (vmapped), in the training dtype.

    The step's tokens: every panel's batch of ``batch`` prompts of T(n̄) tokens of width D, one tensor per n̄
    (``separate``) or one at n̄_max (``padded``, and the native kernels), per token format; and every model's
    saved forward values (:func:`_token_floats`) over its batch, for each (kind, panel, n̄).
    """
    S, B, item = config.seeds, config.batch, itemsize(config.dtype)
    n_bars, n_max = config.n_bars, max(config.n_bars)
    one_draw = config.nbar_layout == "padded" or backend() == "native"
    tokens = 0.0
    for family in {kind.family for kind in kinds.values()}:
        D = token_width(family, config.d, config.p)
        T = [prompt_tokens(family, n_max)] if one_draw else [prompt_tokens(family, nb) for nb in n_bars]
        tokens += 2.0 * n_panels * B * D * sum(T)
    native = backend() == "native"
    models = sum(len(kind.panels) * _token_floats(config, kind, n_max if one_draw else nb, native)
                 for kind in kinds.values() for nb in n_bars)
    return total([(item * S * tokens, f"the token batches of {n_panels} panel(s) × {B} prompts × {S} seed(s)"),
                  (item * S * B * models, f"the saved activations of every model over {B} prompts × {S} seed(s)"),
                  (records(seeds=S, steps=config.steps, record_every=config.record_every, values=2, item=item),
                   "the recorded loss")])


def evaluation_memory(config: TrainConfig, kinds: dict[str, Kind], n_panels: int, n_classes: int) -> Term:
    """Upper estimate of :func:`evaluate`'s memory, float64: one chunk of test prompts (their tokens at every n̄,
    and the forward values of one model at a time on them), and every (seed, panel)'s per-prompt squared errors of
    its models and reference predictors at every n̄, kept to the end (and a chunk list beside the current
    panel's)."""
    n_bars, G, S = config.n_bars, len(config.n_bars), config.seeds
    chunk = min(config.eval_chunk, config.n_eval)
    padded = config.nbar_layout == "padded"
    at = [max(n_bars)] * G if padded else list(n_bars)
    per_chunk = 0.0
    for family in {kind.family for kind in kinds.values()}:
        D = token_width(family, config.d, config.p)
        per_chunk += 2.0 * chunk * D * sum(prompt_tokens(family, nb) for nb in at)
    # forward only: one model's values at a time (freed before the next model's)
    per_chunk += chunk * max(_token_floats(config, kind, nb) for kind in kinds.values() for nb in at)
    rows = S * (sum(len(kind.panels) for kind in kinds.values()) + n_panels * n_classes)
    return total([(FLOAT64 * per_chunk, f"a chunk of {chunk} float64 test prompts and the models' forward values"),
                  (2.0 * FLOAT64 * rows * G * config.n_eval,
                   f"the per-prompt squared errors of {config.n_eval} test prompts × {G} n̄ × {rows} models and "
                   "references")])


def baselines_memory(config: TaskConfig, kinds: Sequence[str], n_panels: int, *, N: int) -> Term:
    """Upper estimate of the restricted models and the held-out baselines (:func:`train_restricted`,
    :func:`restricted_algorithm_match`, :func:`bayes_risks`), float64: the (K n̄_max)² correlation matrices of
    every (panel, n̄), and each seed's models' risks through them with their gradients; N held-out prompts with
    the Bayes posterior's ((K+1)d)² covariances."""
    n = K * max(config.n_bars)
    G, S, d = len(config.n_bars), config.seeds, config.d
    tokens = (n + K + 1) * (d + 1 + config.p)
    return total([(FLOAT64 * n_panels * G * n * n * (2 + 4 * S * max(len(kinds), 1)),
                   f"the (K n̄_max)² correlation matrices of {n_panels} panel(s) × {G} n̄ and the restricted models' "
                   "risks through them"),
                  (FLOAT64 * N * (8 * tokens + 4 * ((K + 1) * d) ** 2), f"the {N} held-out prompts")])


# --------------------------------------------------------------------------------------------
# Evaluation


def evaluate(config: TrainConfig, kinds: dict[str, Kind], params: dict, panels, refs: dict, reporter=None, *,
             n_max: int | None = None, classes: Sequence[str] | None = None) -> dict:
    """Test risks of trained models on fresh float64 prompts, with the control variates of the module docstring.

    Args:
        config, kinds, panels: as in ``train_models``.
        params: name -> final params (S, P_kind, G, ...).
        refs: ``theory_refs`` output for (panels, config.n_bars, n_max).
        reporter: progress reporter (None: silent).
        n_max: the block size of the test prompts' draw (default max(config.n_bars); a shard gives the grid's).
        classes: the reference classes evaluated (default those of ``kinds``; a shard gives the whole grid's).
    Returns:
        dict of arrays normalised by d: risk_<name>, raw_<name>, se_<name>, se_raw_<name> (S·R, P, G), one row
        per run (seed s, restart j at row s·R + j, R = the most restarts of a panel; NaN where a kind is not
        trained), ref_raw_<cls>, ref_se_<cls> (S, P, G).
    """
    n_bars = config.n_bars
    n_max, G, d, S = max(n_bars) if n_max is None else n_max, len(n_bars), config.d, config.seeds
    sigma = float(np.sqrt(config.sigma2))
    need = {_fmt(kind.family) for kind in kinds.values()}
    smask = jnp.asarray(sample_masks(n_max, n_bars))
    tmasks = {"delim": jnp.asarray(token_masks(n_max, n_bars, True)),
              "plain": jnp.asarray(token_masks(n_max, n_bars, False))}
    contexts = sample_contexts(config)
    keys = seed_keys(config.seed, config.seeds)
    factors = panel_factors(panels)
    chunk_size = min(config.eval_chunk, config.n_eval)
    n_chunks = -(-config.n_eval // chunk_size)
    predict = {name: get_model(kind.family).predict for name, kind in kinds.items()}

    @jax.jit
    def chunk(params_panel, ctx, key, factor, ref_P, ref_w):
        pr = mt.sample_blocks(key, chunk_size, [n_max] * K, factor, None, sigma, d=d)
        errs = {name: [] for name in params_panel}
        if config.nbar_layout == "padded":
            toks = _tokens(pr, ctx, n_max, n_max, config, need)
            for name, p in params_panel.items():
                kind = name.split("#")[0]
                fmt = _fmt(kinds[kind].family)
                pred = jax.vmap(lambda p_g, m, f=predict[kind], fmt=fmt: f(p_g, toks[fmt], m, label=d))(p, tmasks[fmt])
                errs[name] = (pred - pr.y_query) ** 2
        else:
            for g, nb in enumerate(n_bars):
                toks = _tokens(pr, ctx, nb, n_max, config, need)
                for name, p in params_panel.items():
                    kind = name.split("#")[0]
                    p_g = jax.tree_util.tree_map(lambda a: a[g], p)
                    errs[name].append((predict[kind](p_g, toks[_fmt(kinds[kind].family)], None, label=d)
                                       - pr.y_query) ** 2)
            errs = {name: jnp.stack(v) for name, v in errs.items()}  # (G, N)
        for cls in ref_P:  # the padded layout: ω = 0 on the samples a model does not see
            pred = jax.vmap(lambda P, w: wpgd_predict(P, w, pr.x, pr.y, pr.x_query))(ref_P[cls], ref_w[cls] * smask)
            errs["ref_" + cls] = (pred - pr.y_query) ** 2
        return errs

    classes = sorted({kind.ref for kind in kinds.values()} if classes is None else set(classes))
    sums: dict = {}
    with task(reporter, "evaluate", S * len(panels) * n_chunks) as cb:
        done = 0
        for s in range(S):
            for i in range(len(panels)):
                # keyed by (kind, restart within the panel): panels with the same models share one compiled chunk
                pp = {}
                for name, kind in kinds.items():
                    for r, j in enumerate(j for j, ii in enumerate(kind.panels) if ii == i):
                        pp[f"{name}#{r}"] = jax.tree_util.tree_map(lambda a: jnp.asarray(a[s, j]), params[name])
                ref_P = {c: jnp.asarray(refs[f"P_{c}"][i]) for c in classes}
                ref_w = {c: jnp.asarray(refs[f"omega_{c}"][i]) for c in classes}
                acc = {}
                for c in range(n_chunks):
                    key = jax.random.fold_in(jax.random.fold_in(keys[s], EVAL_STREAM), c)
                    errs = jax.tree_util.tree_map(np.asarray, chunk(pp, contexts[s], key, factors[i], ref_P, ref_w))
                    for k, v in errs.items():
                        acc.setdefault(k, []).append(v)
                    done += 1
                    cb(done, {})
                sums[(s, i)] = {k: np.concatenate(v, axis=1) for k, v in acc.items()}

    out = {}
    nan = np.full((S, len(panels), G), np.nan)
    for name, kind in kinds.items():
        idx = kind.panels
        R = max(idx.count(i) for i in set(idx))
        for key in ("risk", "raw", "se", "se_raw"):
            out[f"{key}_{name}"] = np.full((S * R, len(panels), G), np.nan)
        for s in range(S):
            for j, i in enumerate(idx):
                r = idx[:j].count(i)
                row = s * R + r
                cv = control_variate_risk(sums[(s, i)][f"{name}#{r}"], sums[(s, i)]["ref_" + kind.ref],
                                          refs[f"E_{kind.ref}"][i])
                out[f"risk_{name}"][row, i] = cv["risk"] / d
                out[f"se_{name}"][row, i] = cv["risk_se"] / d
                out[f"raw_{name}"][row, i] = cv["raw"] / d
                out[f"se_raw_{name}"][row, i] = cv["raw_se"] / d
    for cls in classes:
        out[f"ref_raw_{cls}"], out[f"ref_se_{cls}"] = nan.copy(), nan.copy()
        for s in range(S):
            for i in range(len(panels)):
                er = sums[(s, i)]["ref_" + cls]
                out[f"ref_raw_{cls}"][s, i] = er.mean(1) / d
                out[f"ref_se_{cls}"][s, i] = er.std(1) / np.sqrt(er.shape[1]) / d
    return out


# --------------------------------------------------------------------------------------------
# Restricted models on the exact risk (population engine)


RESTRICTED = {"linatt": "none", "gla": "scalar", "gla_vector": "vector"}


def _restricted_shapes(kind: str, d: int, p: int) -> dict:
    out = {"P_k": (d, d), "P_q": (d, d)}
    if kind == "scalar":
        out["w_c"] = (p,)
    elif kind == "vector":
        D = d + 1 + p
        out.update(W_c=(D, p), u=(D,), h=(D,))
    return out


def _restricted_init(kind: str, d: int, p: int, std: float):
    """init(key) -> restricted params, every entry N(0, std²), one normal draw."""
    shapes = _restricted_shapes(kind, d, p)
    sizes = [int(np.prod(s)) for s in shapes.values()]
    offsets = np.cumsum([0] + sizes)

    def init(key):
        flat = std * standard_normal(key, (sum(sizes),), jnp.float64)
        return {name: flat[offsets[i]:offsets[i + 1]].reshape(shape) for i, (name, shape) in enumerate(shapes.items())}

    return init


def train_restricted(config: TaskConfig, kinds: Sequence[str], panels, *, steps: int, lr: float, init_std: float,
                     reporter, record_every: int | None = None, n_max: int | None = None):
    """Restricted models (eq 20 + Thm 4/5 gates on the contexts) trained by Adam on the exact risk eq 37.

    ŷ = xᵀ P_q P_kᵀ Xᵀ(ω ⊙ y) with ω from the gates of the token sequence (``gla.restricted_wpgd``), so the
    exact risk is ``theory.wpgd_risk`` (population engine, no sampling). One model per (kind, panel, n̄), every
    seed (its own contexts and init) at once; the init key of a model is
    fold_in(fold_in(key_s, RESTRICTED_STREAM), member id) as in the joint training.

    Args:
        config: the task setting.
        kinds: restricted kinds (keys of ``RESTRICTED``).
        panels: (P,) sequence of (r₁, r₂), each one of ``PANELS``.
        steps: Adam steps; lr: learning rate; init_std: std of the Gaussian init.
        reporter: progress reporter (None: silent).
        record_every: record spacing (default: steps // 20).
        n_max: the padded block size (default max(config.n_bars); a shard gives the whole grid's, so that
            its models' risks are the same sums as inside the grid).
    Returns:
        (Trajectory, dict kind -> (S, P, G) final exact risk / d).
    """
    n_bars = config.n_bars
    n_max, G, d = max(n_bars) if n_max is None else n_max, len(n_bars), config.d
    Rs = np.zeros((len(panels), G, K * n_max, K * n_max))
    rs = np.zeros((len(panels), G, K * n_max))
    for i, (r1, r2) in enumerate(panels):
        for g, nb in enumerate(n_bars):
            Rs[i, g], rs[i, g] = padded_correlation(n_max, nb, r1=r1, r2=r2)
    Rs, rs = jnp.asarray(Rs), jnp.asarray(rs)
    smask = jnp.asarray(sample_masks(n_max, n_bars))
    I = jnp.eye(d)
    keys = seed_keys(config.seed, config.seeds)

    def risks(params, aux):
        out = {}
        for kind in kinds:
            def one(rp, R, r, m):
                P, om = gla.restricted_wpgd(rp, aux["contexts"], [n_max] * K, query_context=config.qc(), mask=m)
                return theory.wpgd_risk(P, om, I, R, r, config.sigma2)

            per = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, 0)), in_axes=(0, 0, 0, None))
            out[kind] = per(params[kind], Rs, rs, smask)
        return out

    def loss_fn(params, aux):
        return sum(jnp.sum(v) for v in risks(params, aux).values())

    params0 = {}
    for kind in kinds:
        ids = member_ids(Kind(kind, "", tuple(range(len(panels))), list(RESTRICTED).index(kind)), panels, n_bars)
        init = _restricted_init(RESTRICTED[kind], d, config.p, init_std)
        params0[kind] = jax.jit(jax.vmap(lambda key: jax.vmap(jax.vmap(init))(member_keys(key, ids, RESTRICTED_STREAM))))(
            keys)
    aux = {"contexts": sample_contexts(config)}
    rec = record_every or max(1, steps // 20)
    with task(reporter, "restricted models, exact risk (population engine)", steps) as cb:
        tr = population.gradient_descent(loss_fn, params0, aux, lr=lr, n_steps=steps,
                                         optimizer=optax.scale_by_adam(), record_every=rec, batched=True, callback=cb)
    out = jax.vmap(risks)(tr.final_params, aux)
    return tr, {k: np.asarray(v) / d for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Baselines on held-out prompts: algorithm match and the Bayes risk


def match_prompts(config: TaskConfig, key_s, panel, n_bar: int, N: int):
    """N held-out float64 prompts of (r₁, r₂) = ``panel`` with n̄ samples per block, drawn from
    fold_in(fold_in(fold_in(key_s, MATCH_STREAM), panel index in PANELS), n̄): streams no training or test uses.

    Returns:
        ``iclab.tasks.multitask.MultitaskPrompts`` (x (N, K n̄, d), y, x_query, y_query).
    """
    code = PANELS.index(tuple(float(v) for v in panel))
    factor = jnp.asarray(mt.two_task_factor(r1=float(panel[0]), r2=float(panel[1])))
    return _draw_match(key_s, code, factor, float(np.sqrt(config.sigma2)), N=N, n_bar=n_bar, d=config.d)


@functools.partial(jax.jit, static_argnames=("N", "n_bar", "d"))
def _draw_match(key_s, code, factor, sigma, *, N: int, n_bar: int, d: int):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key_s, MATCH_STREAM), code), n_bar)
    return mt.sample_blocks(key, N, [n_bar] * K, factor, None, sigma, d=d)


# One compilation per n̄, each run once per (seed, panel) on ~10³ prompts: compiling without LLVM optimisation
# saves most of the time (the same values to rounding).
@functools.partial(jax.jit, static_argnames=("family", "n_bar", "d", "qc"),
                   compiler_options={"xla_backend_optimization_level": 0})
def _restricted_match(rparams, contexts, P_opt, omega_opt, prompts, *, family: str, n_bar: int, d: int, qc):
    """A restricted model (as the full GLA on delimiter tokens) against WPGD (P_opt, ω_opt) on the same prompts."""
    full = gla.restricted_to_full(rparams, d, contexts.shape[-1])
    forward = get_model(family).predict

    def model(pr):
        Z = gla.delimiter_prompt(pr.x, pr.y, pr.x_query, [n_bar] * K, contexts, query_context=qc)[0]
        return forward(full, Z, None, label=d)

    alg = baselines.on_prompts(baselines.wpgd, P=P_opt, omega=omega_opt)
    m = baselines.algorithm_match(model, alg, prompts)
    risk = baselines.mc_risk(alg, prompts)
    return {"gap": m.gap, "gap_se": m.gap_se, "cosine": m.cosine, "cosine_se": m.cosine_se,
            "alg_risk": risk.mean, "alg_risk_se": risk.se}


def restricted_algorithm_match(config: TaskConfig, family: str, rparams, panels, *, N: int, reporter=None) -> dict:
    """Issue 22: trained restricted models against the optimal WPGD predictor (eq 17) on held-out prompts.

    The model is the full one-layer GLA built from the restricted weights (``gla.restricted_to_full``) reading
    the delimiter tokens of eq 19; the algorithm is ŷ = x_qᵀP*Xᵀ(ω* ⊙ y) with (P*, ω*) the global WPGD optimum
    of the prompt's setting (``theory.wpgd_optimum``), on plain arrays (``iclab.baselines.wpgd``). Both read the
    same N prompts of :func:`match_prompts` per (seed, panel, n̄ ≥ 1).

    Args:
        config: the task setting (d, p, σ², n̄ grid, query context).
        family: the registered family of the restricted kind (``linatt``, ``gla``, ``gla_vector``).
        rparams: its restricted params with leading (S, P, G) axes (``train_restricted``'s final params).
        panels: (P,) sequence of (r₁, r₂).
        N: held-out prompts per (seed, panel, n̄).
        reporter: progress reporter (None: silent).
    Returns:
        dict of (S, P, G) arrays, NaN at n̄ = 0: gap (E(ŷ − ŷ*)², unnormalised), gap_se, cosine, cosine_se,
        alg_risk, alg_risk_se (the optimum's Monte Carlo risk, no ½), opt_risk (L*_WPGD, eq 17 / Thm 2).
    """
    n_bars = config.n_bars
    S, P_, G = config.seeds, len(panels), len(n_bars)
    keys = seed_keys(config.seed, config.seeds)
    contexts = sample_contexts(config)
    names = ("gap", "gap_se", "cosine", "cosine_se", "alg_risk", "alg_risk_se", "opt_risk")
    out = {k: np.full((S, P_, G), np.nan) for k in names}
    I = np.eye(config.d)
    with task(reporter, f"match restricted {family} with optimal WPGD", P_ * G) as cb:
        for i, (r1, r2) in enumerate(panels):
            for g, nb in enumerate(n_bars):
                cb(i * G + g + 1, {})
                if nb == 0:
                    continue
                R, r = theory.two_task_correlation(nb, r1=r1, r2=r2)
                opt = theory.wpgd_optimum(I, R, r, config.sigma2)
                for s in range(S):
                    rp = jax.tree_util.tree_map(lambda a: jnp.asarray(a[s, i, g]), rparams)
                    res = _restricted_match(rp, contexts[s], jnp.asarray(opt.P), jnp.asarray(opt.omega),
                                            match_prompts(config, keys[s], (r1, r2), nb, N), family=family,
                                            n_bar=nb, d=config.d, qc=config.qc())
                    for k, v in res.items():
                        out[k][s, i, g] = float(v)
                    out["opt_risk"][s, i, g] = opt.risk
    return out


@functools.partial(jax.jit, static_argnames=("n_bar",))
def _bayes_risk(x, factor, sigma2, *, n_bar: int):
    r = baselines.multitask_bayes_risk(x, block_sizes=(n_bar,) * K, factor=factor, sigma2=sigma2)
    e = baselines.mean_and_se(r)
    return e.mean, e.se


def bayes_risks(config: TaskConfig, panels, *, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Bayes risk of the data model (App B.1, Defs 1-2) per (seed, panel, n̄), no ½: the exact conditional risk
    given the context inputs (``iclab.baselines.multitask_bayes_risk``, the query integrated out) averaged over
    the contexts of the N held-out prompts of :func:`match_prompts`; n̄ = 0 is d + σ² exactly (ŷ = 0).

    Returns:
        (mean, standard error), each (S, P, G), unnormalised.
    """
    n_bars = config.n_bars
    S, P_, G = config.seeds, len(panels), len(n_bars)
    keys = seed_keys(config.seed, config.seeds)
    mean, se = np.full((S, P_, G), config.d + config.sigma2), np.zeros((S, P_, G))
    for i, (r1, r2) in enumerate(panels):
        factor = jnp.asarray(mt.two_task_factor(r1=r1, r2=r2))
        for g, nb in enumerate(n_bars):
            if nb == 0:
                continue
            for s in range(S):
                pr = match_prompts(config, keys[s], (r1, r2), nb, N)
                m, e = _bayes_risk(pr.x, factor, config.sigma2, n_bar=nb)
                mean[s, i, g], se[s, i, g] = float(m), float(e)
    return mean, se


# --------------------------------------------------------------------------------------------
# Shards (iclab run --executor): independent parts of a figure


#: n̄ values per shard of the gating figures: the paper preset's 10 make 5 blocks, so 20 shards for Fig 1 (4 panels)
#: and 15 for Fig 2 (3 depths). In the padded layout a block costs its size × T(n̄_max) per step, so equal blocks
#: cost the same; each shard also draws the step's batch at n̄_max and compiles its own loop, which a larger
#: block shares among more models.
NBAR_BLOCK = 2


def nbar_blocks(n_bars: Sequence[int], size: int = NBAR_BLOCK) -> list[list[int]]:
    """The n̄ grid cut into consecutive blocks of at most ``size`` values (the last one may be shorter)."""
    n_bars = list(n_bars)
    return [n_bars[k:k + size] for k in range(0, len(n_bars), size)]


def block_label(block: Sequence[int]) -> str:
    """A block's part of a shard name: ``n<first>-<last>``."""
    return f"n{block[0]}-{block[-1]}"


def put_block(out: dict, key: str, value, full_shape: tuple, where: tuple) -> None:
    """Writes a shard's array into the figure's (NaN-filled on first use) at index ``where``.

    Args:
        out: the figure's arrays being assembled; key: the array's name.
        value: the shard's entries, broadcastable to ``full[where]``.
        full_shape: the figure's shape of this array.
        where: an index of the figure's array (tuples of ints and slices).
    """
    if key not in out:
        out[key] = np.full(full_shape, np.nan, dtype=np.result_type(np.asarray(value).dtype, np.float64))
    out[key][where] = value


def summed_loss(parts: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(train_step, train_loss) of a grid from its shards': the same record steps, the summed loss Σ_m ℓ_m
    (summed in float64, stored in the shards' dtype).

    Raises:
        ValueError: shards recorded at different steps (they were not parts of one run).
    """
    step = np.asarray(parts[0]["train_step"])
    for part in parts[1:]:
        if not np.array_equal(np.asarray(part["train_step"]), step):
            raise ValueError("shards recorded their training loss at different steps")
    dtype = np.asarray(parts[0]["train_loss"]).dtype
    return step, np.sum([np.asarray(p["train_loss"], dtype=np.float64) for p in parts], axis=0).astype(dtype)
