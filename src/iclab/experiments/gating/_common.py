"""Shared pieces of the gating experiments: configs, one joint trainer for a grid of GLA models, their
evaluation against the closed forms of ``iclab.theory.wpgd``, and the restricted models on the exact risk.

Joint training (spec §5): every model of a seed — each kind (LinAtt, GLA, GLA-wo, GLA-vector, L-layer GLA),
each panel (r₁, r₂) and each n̄ — is trained in ONE ``sampled.minibatch`` run on the sum of the models'
batch losses. Adam acts elementwise, so each model follows exactly the updates it would get alone (up to
Adam's ε). All models of a seed share each step's random numbers: one draw of inputs x and task normals G
at the largest n̄ serves every panel (β = L_panel G) and every n̄ (a token mask keeps the last n̄ samples of
each block; masked tokens contribute nothing and gate 1, so the model sees exactly the shorter prompt).
Seeds are vmapped by the engine.

Evaluation: the MSE of a model on N fresh prompts has a relative standard error of about √(2/N), too coarse
for a 5 % comparison at affordable N. Each model is therefore evaluated beside the optimal predictor of the
closed form it is compared with (eq 24 for LinAtt and GLA-wo, eq 22 for GLA, Thm 5 for GLA-vector, eq 17
for multi-layer GLA), ŷ_ref = xᵀ P_ref Xᵀ(ω_ref ⊙ y), on the SAME prompts, and its risk is estimated as

    err ≈ E_ref + mean[(ŷ_model − y)² − (ŷ_ref − y)²],

unbiased because E[(ŷ_ref − y)²] = E_ref exactly (eq 37 under Defs 1-2); the difference has a small variance
when the trained model predicts nearly what the optimum does, and a large one when it does not. The raw
Monte-Carlo MSEs are kept, and the reference predictors' raw MSEs are checked against E_ref (a test of the
sampler and the closed forms that involves no training).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import field_validator, model_validator

from iclab.engines import population, sampled
from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._plot import COLORS
from iclab.models import gla
from iclab.tasks import multitask as mt
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


class ModelSpec(NamedTuple):
    """A trained model kind: gate, token format, head, depth, and the reference class of its control variate."""

    gating: str
    delimiters: bool
    head: bool
    layers: int
    label: str
    ref: str


FIG1_MODELS = {
    "linatt": ModelSpec("none", True, False, 1, "LinAtt", "att"),
    "gla": ModelSpec("scalar", True, False, 1, "GLA", "scalar"),
    "gla_wo": ModelSpec("scalar", False, False, 1, "GLA-wo", "half"),
    "gla_vector": ModelSpec("vector", True, True, 1, "GLA-vector", "vector"),
}


class TaskConfig(ExperimentConfig):
    """The multitask setting of App B.1: K = 2 independent tasks of n̄ samples each, Σ = I."""

    d: int = param(10, "input dimension d", paper=10, ge=1, le=64)
    p: int = param(5, "context (delimiter) dimension p", paper=5, ge=1, le=64)
    sigma2: float = param(0.0, "label-noise variance σ²", paper=0.0, ge=0, le=100)
    n_bars: list[int] = param([0, 1, 2, 5, 10, 15, 20, 30, 40, 50], "samples per task n̄ (one model per n̄)",
                              paper="0..50", paper_note="'vary n̄ from 0 to 50'; the grid is unspecified")
    query_context: Literal["c0", "zero"] = param(
        "c0", "context part of the query token: c̄_0 (as data tokens) or 0", paper=None,
        paper_note="unspecified (spec §7); the Thm 4 proof needs query gate 1, i.e. c̄_0")

    @field_validator("n_bars")
    @classmethod
    def _sorted(cls, value):
        if len(value) == 0 or any(v < 0 for v in value) or sorted(set(value)) != list(value):
            raise ValueError("n_bars must be a nonempty increasing list of distinct integers >= 0")
        if value[-1] < 1:
            raise ValueError("n_bars must contain a value >= 1")
        return value

    def qc(self):
        """query_context as the index of ``delimiter_prompt`` (0) or None (zero context)."""
        return 0 if self.query_context == "c0" else None


class TrainConfig(TaskConfig):
    """Adam on fresh minibatches (App B.1), evaluation on fresh prompts."""

    batch: int = param(256, "prompts per step (a fresh batch every step)", paper=256, ge=1, le=100_000)
    steps: int = param(10_000, "Adam steps", paper=10_000, ge=1, le=10_000_000)
    lr: float = param(1e-3, "Adam learning rate (peak of the schedule)", paper=1e-3, gt=0, le=10)
    lr_schedule: Literal["constant", "cosine"] = param(
        "constant", "learning-rate schedule: constant, or cosine decay to 0", paper="constant",
        paper_note="unspecified; read as constant")
    init_std: float = param(0.1, "std of the Gaussian init of every weight entry", paper=None,
                            paper_note="unspecified", gt=0, le=10)
    init_identity: float = param(
        0.3, "identity added to the init of W_q, W_k, W_v (and init_identity·e_y to a head h)", paper=None,
        paper_note="unspecified; 0 is a plain Gaussian init, from which about 40 % of runs stall in a rank-one "
        "saddle (value reads x, key reads y) — the paper's best-of-10 protocol absorbs that", ge=0, le=10)
    clip_norm: float = param(
        0.0, "clip each model's gradient to this Euclidean norm before Adam (0: no clipping)", paper=None,
        paper_note="unspecified; every model (kind, panel, n̄) of a seed is clipped by its own norm", ge=0, le=1e6)
    dtype: Literal["float32", "float64"] = param("float32", "training dtype (evaluation is float64)", paper=None,
                                                 paper_note="unspecified (PyTorch default float32)")
    nbar_layout: Literal["separate", "padded"] = param(
        "separate", "how the models of different n̄ see their prompts: one token tensor per n̄ (arithmetic Σ_n̄ "
        "T(n̄), a traced graph per n̄), or one tensor at the largest n̄ with token masks, vmapped over n̄ "
        "(arithmetic G·T(n̄_max), one small graph); both give the same models", paper=None,
        paper_note="implementation choice: 'padded' for long n̄ grids (the paper's 51 values), whose separate "
        "graphs take longer to compile than to run")
    n_eval: int = param(20_000, "fresh test prompts per seed and panel (shared by all models)", paper=None,
                        paper_note="unspecified", ge=100, le=10_000_000)
    eval_chunk: int = param(2048, "test prompts evaluated per jitted call (memory bound)", ge=1, le=1_000_000)
    record_every: int = param(250, "record the summed training loss every this many steps", ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _chunk(self):
        if self.eval_chunk > self.n_eval:
            object.__setattr__(self, "eval_chunk", self.n_eval)
        return self

    def schedule(self):
        return optax.cosine_decay_schedule(self.lr, self.steps) if self.lr_schedule == "cosine" else self.lr

    def jnp_dtype(self):
        return jnp.float32 if self.dtype == "float32" else jnp.float64


def fast_key(key: jax.Array) -> jax.Array:
    """An RngBitGenerator ("rbg") key derived from a raw threefry key, for the samplers inside jitted loops.

    Threefry compiles for seconds per call site on CPU, rbg in about one; the stream stays a deterministic
    function of the engine's fold_in(key, step).
    """
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    data = jnp.asarray(data, jnp.uint32)
    return jax.random.wrap_key_data(jnp.concatenate([data, data ^ jnp.uint32(0x9E3779B9)]), impl="rbg")


def numpy_init(config, lead: tuple, stream: int, structure, init_std: float):
    """Gaussian init N(0, init_std²) of every entry of the pytree ``structure()`` with leading axes ``lead``.

    Drawn with numpy from (seed, stream): a jitted init with one random-number site per array compiles for
    many seconds on CPU, and the init is no part of the training loop.
    """
    shapes = jax.eval_shape(structure)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    per_seed = []
    for s in range(lead[0]):  # seed s's init does not depend on how many seeds run
        rng = np.random.default_rng([config.seed, s, 1000 + stream])
        per_seed.append([init_std * rng.standard_normal(lead[1:] + sd.shape) for sd in leaves])
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(np.stack([p[i] for p in per_seed]), dtype=sd.dtype) for i, sd in enumerate(leaves)])


def add_identity(params, scale: float, label: int):
    """W_{q,k,v} += scale·I and h += scale·e_label on an init (leading axes broadcast); of an L-layer model
    (a list) only the first layer.

    Layers 2..L keep the small Gaussian init, so the residual stack of eq 25 starts near the one-layer
    model: an identity in every layer makes each layer cubic in its input (z ↦ z + (zW_q)(ZW_k)ᵀ(ZW_v)) and
    the 3-layer output overflows float32 at the first step.
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


def seed_keys(config: ExperimentConfig) -> jax.Array:
    """One key per seed: fold_in(PRNGKey(seed), s), s = 0..seeds−1. Returns (seeds, 2)."""
    base = jax.random.PRNGKey(config.seed)
    return jnp.stack([jax.random.fold_in(base, s) for s in range(config.seeds)])


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
    return np.stack([mt.two_task_factor(r1, r2) for r1, r2 in panels])


# --------------------------------------------------------------------------------------------
# Theory: curves and the optimal predictors used as control variates


def padded_correlation(n_max: int, n_bar: int, r1: float, r2: float):
    """(R, r) of App B.1 in the padded layout: entries of masked slots are 0. Returns (K n_max, K n_max), (K n_max,)."""
    m = mt.padding_mask([n_max] * K, [n_bar] * K)
    owner = np.repeat(np.arange(K), n_max)
    R = (owner[:, None] == owner[None, :]) * np.outer(m, m)
    r = np.array([r1, r2])[owner] * m
    return R.astype(float), r.astype(float)


def half_gate_weights(n: int) -> np.ndarray:
    """ω_j = 2^{−(n+1−j)}, j = 1..n: the WPGD weights of scalar gates all equal to ½ (eq 11), query gate included.

    Without delimiters every token is [x; y], mean zero, and the gate φ(w_gᵀz) has no bias; the trained GLA-wo
    settles at w_g ≈ 0, i.e. these weights [derived, observed in training].
    """
    return 0.5 ** (n - np.arange(n))


def theory_refs(d: int, sigma2: float, panels, n_bars, n_max: int) -> dict:
    """Closed-form curves and optimal predictors, per panel and n̄, in the padded layout.

    Returns a dict of numpy arrays (unnormalised risks):
        eq17, eq24 (P, G): L*_WPGD (eq 17) and L*_ATT (eq 24);
        E_<cls> (P, G), P_<cls> (P, G, d, d), omega_<cls> (P, G, K n_max) for cls in att (ω = 1, eq 24),
        scalar (eq 22, Thm 4), vector (Thm 5) and half (every gate ½, ``half_gate_weights``: GLA-wo's
        optimum among constant gates [derived]); n̄ = 0 gives ŷ = 0 and risk d + σ².
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
            R, r = theory.two_task_correlation(nb, r1, r2)
            out["eq17"][i, g] = theory.wpgd_optimal_risk_isotropic(R, r, d, sigma2)
            out["eq24"][i, g] = theory.linear_attention_risk_isotropic(R, r, d, sigma2)
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


def _init_spec(key, spec: ModelSpec, D: int, std: float, dtype):
    if spec.layers == 1:
        return gla.init_params(key, D, spec.gating, head=spec.head, std=std, dtype=dtype)
    return [gla.init_params(jax.random.fold_in(key, l), D, spec.gating, std=std, dtype=dtype)
            for l in range(spec.layers)]


def spec_predict(spec: ModelSpec, params, Z, mask, label: int):
    """Prediction of one model of a kind (one or L layers)."""
    if spec.layers == 1:
        return gla.predict(params, Z, mask, label=label)
    return gla.predict_multilayer(params, Z, mask, label=label)


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


def clip_per_model(max_norm: float, lead: int) -> optax.GradientTransformation:
    """Scales each model's gradient to norm ≤ max_norm. Updates are a dict kind -> pytree whose leaves share
    ``lead`` leading axes (panel, n̄ in ``train_models``), one model per index: the loss is a sum of
    independent models, and one global norm would couple them."""

    def clip(tree):
        leaves = jax.tree_util.tree_leaves(tree)
        sq = sum(jnp.sum(g.reshape(g.shape[:lead] + (-1,)) ** 2, axis=-1) for g in leaves)
        factor = jnp.minimum(1.0, max_norm / jnp.maximum(jnp.sqrt(sq), 1e-30))
        return jax.tree_util.tree_map(lambda g: g * factor.reshape(factor.shape + (1,) * (g.ndim - lead)).astype(
            g.dtype), tree)

    def update(updates, state, params=None):
        return {kind: clip(tree) for kind, tree in updates.items()}, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def train_models(config: TrainConfig, models: dict, panels, reporter, label: str = "train", tag: int = 0):
    """Trains one model per (kind, panel, n̄) for every seed, jointly (module docstring).

    Args:
        config: training setting.
        models: name -> (ModelSpec, panel indices (tuple) where that kind is trained); a panel index may repeat,
            each repeat an independent initialisation (a restart) trained on the same data stream.
        panels: (P,) sequence of (r₁, r₂).
        reporter: progress reporter.
        tag: distinguishes the keys of several joint runs of one experiment.
    Returns:
        (Trajectory of the summed loss, dict name -> final params with leading (S, P_kind, G) axes, float64).
    """
    dt = config.jnp_dtype()
    n_bars = config.n_bars
    n_max, G = max(n_bars), len(n_bars)
    d = config.d
    factors = jnp.asarray(panel_factors(panels), dt)
    keys = seed_keys(config)
    S = config.seeds
    contexts = sample_contexts(config).astype(dt)
    need = {"delim" if spec.delimiters else "plain" for spec, _ in models.values()}
    sigma = float(np.sqrt(config.sigma2))

    params0 = {name: numpy_init(config, (S, len(idx), G), j + 10 * tag,
                                lambda: _init_spec(jax.random.PRNGKey(0), spec, d + 1 + (config.p if spec.delimiters else 0),
                                                   1.0, dt), config.init_std)
               for j, (name, (spec, idx)) in enumerate(models.items())}
    params0 = {name: add_identity(p, config.init_identity, d) for name, p in params0.items()}

    padded = config.nbar_layout == "padded"
    masks = {"delim": jnp.asarray(token_masks(n_max, n_bars, True), dt),
             "plain": jnp.asarray(token_masks(n_max, n_bars, False), dt)}

    def sampler(key, aux):
        key = fast_key(key)
        pr = jax.vmap(lambda L: mt.sample_blocks(key, config.batch, [n_max] * K, L, None, sigma, d=d, dtype=dt))(factors)
        if padded:  # one token tensor at n̄_max; the models of smaller n̄ mask the first samples of each block
            return {"tokens": _tokens(pr, aux["contexts"], n_max, n_max, config, need), "y": pr.y_query}
        # one token tensor per n̄ (the cost is Σ_n̄ T(n̄), not G·T(n̄_max))
        return {"tokens": [_tokens(pr, aux["contexts"], nb, n_max, config, need) for nb in n_bars], "y": pr.y_query}

    def loss_fn(params, batch):
        total = 0.0
        for name, (spec, idx) in models.items():
            fmt = "delim" if spec.delimiters else "plain"
            sel = jnp.asarray(idx)

            def one(p, Z, y, mask=None, spec=spec):
                return jnp.mean((spec_predict(spec, p, Z, mask, d) - y) ** 2)

            if padded:
                per_nbar = jax.vmap(one, in_axes=(0, None, None, 0))  # params (G, ...), masks (G, T)
                per_panel = jax.vmap(per_nbar, in_axes=(0, 0, 0, None))
                total = total + jnp.sum(per_panel(params[name], batch["tokens"][fmt][sel], batch["y"][sel],
                                                  masks[fmt]))
                continue
            for g in range(G):
                p_g = jax.tree_util.tree_map(lambda a: a[:, g], params[name])
                total = total + jnp.sum(jax.vmap(one)(p_g, batch["tokens"][g][fmt][sel], batch["y"][sel]))
        return total

    aux = {"contexts": contexts}
    data_keys = jax.vmap(lambda k: jax.random.fold_in(k, 20 + tag))(keys)
    optimizer = optax.adam
    if config.clip_norm > 0:
        def optimizer(learning_rate):
            return optax.chain(clip_per_model(config.clip_norm, lead=2), optax.adam(learning_rate))
    with reporter.task(label, config.steps) as cb:
        tr = sampled.minibatch(loss_fn, params0, sampler, data_keys, aux, lr=config.schedule(), n_steps=config.steps,
                               optimizer=optimizer, record_every=config.record_every, batched=True,
                               record_params=True, callback=cb)
    final = jax.tree_util.tree_map(lambda a: np.asarray(a[:, -1], dtype=np.float64), tr.params)
    return tr._replace(params=None), final


# --------------------------------------------------------------------------------------------
# Evaluation


def evaluate(config: TrainConfig, models: dict, params: dict, panels, refs: dict, reporter=None, tag: int = 0) -> dict:
    """Test risks of trained models on fresh float64 prompts, with the control variates of the module docstring.

    Args:
        config, models, panels: as in ``train_models``.
        params: name -> final params (S, P_kind, G, ...).
        refs: ``theory_refs`` output for (panels, config.n_bars, max n̄).
    Returns:
        dict of arrays normalised by d: risk_<name>, raw_<name>, se_<name>, se_raw_<name> (S·R, P, G), one row
        per run (seed s, restart j at row s·R + j, R = the most restarts of a panel; NaN where a kind is not
        trained), ref_raw_<cls>, ref_se_<cls> (S, P, G).
    """
    n_bars = config.n_bars
    n_max, G, d, S = max(n_bars), len(n_bars), config.d, config.seeds
    sigma = float(np.sqrt(config.sigma2))
    need = {"delim" if spec.delimiters else "plain" for spec, _ in models.values()}
    smask = jnp.asarray(sample_masks(n_max, n_bars))
    tmasks = {"delim": jnp.asarray(token_masks(n_max, n_bars, True)),
              "plain": jnp.asarray(token_masks(n_max, n_bars, False))}
    contexts = sample_contexts(config)
    keys = seed_keys(config)
    factors = panel_factors(panels)
    n_chunks = -(-config.n_eval // config.eval_chunk)

    @jax.jit
    def chunk(params_panel, ctx, key, factor, ref_P, ref_w):
        pr = mt.sample_blocks(fast_key(key), config.eval_chunk, [n_max] * K, factor, None, sigma, d=d)
        errs = {name: [] for name in params_panel}
        if config.nbar_layout == "padded":
            toks = _tokens(pr, ctx, n_max, n_max, config, need)
            for name, p in params_panel.items():
                spec = models[name.split("#")[0]][0]
                fmt = "delim" if spec.delimiters else "plain"
                pred = jax.vmap(lambda p_g, m, spec=spec, fmt=fmt: spec_predict(spec, p_g, toks[fmt], m, d))(
                    p, tmasks[fmt])
                errs[name] = (pred - pr.y_query) ** 2
        else:
            for g, nb in enumerate(n_bars):
                toks = _tokens(pr, ctx, nb, n_max, config, need)
                for name, p in params_panel.items():
                    spec = models[name.split("#")[0]][0]
                    p_g = jax.tree_util.tree_map(lambda a: a[g], p)
                    errs[name].append((spec_predict(spec, p_g, toks["delim" if spec.delimiters else "plain"], None,
                                                    d) - pr.y_query) ** 2)
            errs = {name: jnp.stack(v) for name, v in errs.items()}  # (G, N)
        for cls in ref_P:  # the padded layout: ω = 0 on the samples a model does not see
            pred = jax.vmap(lambda P, w: wpgd_predict(P, w, pr.x, pr.y, pr.x_query))(ref_P[cls], ref_w[cls] * smask)
            errs["ref_" + cls] = (pred - pr.y_query) ** 2
        return errs

    classes = sorted({spec.ref for spec, _ in models.values()})
    sums: dict = {}
    total = S * len(panels) * n_chunks
    ctx_mgr = reporter.task("evaluate", total) if reporter is not None else None
    cb = ctx_mgr.__enter__() if ctx_mgr is not None else None
    try:
        done = 0
        for s in range(S):
            for i in range(len(panels)):
                pp = {}
                for name, (spec, idx) in models.items():
                    for j in (j for j, ii in enumerate(idx) if ii == i):
                        pp[f"{name}#{j}"] = jax.tree_util.tree_map(lambda a: jnp.asarray(a[s, j]), params[name])
                ref_P = {c: jnp.asarray(refs[f"P_{c}"][i]) for c in classes}
                ref_w = {c: jnp.asarray(refs[f"omega_{c}"][i]) for c in classes}
                acc = {}
                for c in range(n_chunks):
                    key = jax.random.fold_in(jax.random.fold_in(keys[s], 30 + tag), c)
                    errs = jax.tree_util.tree_map(np.asarray, chunk(pp, contexts[s], key, factors[i], ref_P, ref_w))
                    for k, v in errs.items():
                        acc.setdefault(k, []).append(v)
                    done += 1
                    if cb is not None:
                        cb(done, {})
                acc = {k: np.concatenate(v, axis=1) for k, v in acc.items()}
                sums[(s, i)] = acc
    finally:
        if ctx_mgr is not None:
            ctx_mgr.__exit__(None, None, None)

    out = {}
    nan = np.full((S, len(panels), G), np.nan)
    for name, (spec, idx) in models.items():
        R = max(idx.count(i) for i in set(idx))
        for key in ("risk", "raw", "se", "se_raw"):
            out[f"{key}_{name}"] = np.full((S * R, len(panels), G), np.nan)
        for s in range(S):
            for j, i in enumerate(idx):
                row = s * R + idx[:j].count(i)
                e, er = sums[(s, i)][f"{name}#{j}"], sums[(s, i)]["ref_" + spec.ref]
                N = e.shape[1]
                diff = e - er
                out[f"risk_{name}"][row, i] = (refs[f"E_{spec.ref}"][i] + diff.mean(1)) / d
                out[f"se_{name}"][row, i] = diff.std(1) / np.sqrt(N) / d
                out[f"raw_{name}"][row, i] = e.mean(1) / d
                out[f"se_raw_{name}"][row, i] = e.std(1) / np.sqrt(N) / d
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


def _restricted_structure(kind: str, d: int, p: int):
    out = {"P_k": jnp.zeros((d, d)), "P_q": jnp.zeros((d, d))}
    if kind == "scalar":
        out["w_c"] = jnp.zeros(p)
    elif kind == "vector":
        D = d + 1 + p
        out.update(W_c=jnp.zeros((D, p)), u=jnp.zeros(D), h=jnp.zeros(D))
    return out


def train_restricted(config: TaskConfig, kinds: Sequence[str], panels, *, steps: int, lr: float, init_std: float,
                     reporter, record_every: int | None = None):
    """Restricted models (eq 20 + Thm 4/5 gates on the contexts) trained by Adam on the exact risk eq 37.

    ŷ = xᵀ P_q P_kᵀ Xᵀ(ω ⊙ y) with ω from the gates of the token sequence (``gla.restricted_wpgd``), so the
    exact risk is ``theory.wpgd_risk`` (population engine, no sampling). One model per (kind, panel, n̄), every
    seed (its own contexts and init) at once.

    Returns:
        (Trajectory, dict kind -> (S, P, G) final exact risk / d).
    """
    n_bars = config.n_bars
    n_max, G, d = max(n_bars), len(n_bars), config.d
    Rs = np.zeros((len(panels), G, K * n_max, K * n_max))
    rs = np.zeros((len(panels), G, K * n_max))
    for i, (r1, r2) in enumerate(panels):
        for g, nb in enumerate(n_bars):
            Rs[i, g], rs[i, g] = padded_correlation(n_max, nb, r1, r2)
    Rs, rs = jnp.asarray(Rs), jnp.asarray(rs)
    smask = jnp.asarray(sample_masks(n_max, n_bars))
    I = jnp.eye(d)
    keys = seed_keys(config)

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

    params0 = {kind: numpy_init(config, (config.seeds, len(panels), G), 100 + j,
                                lambda: _restricted_structure(RESTRICTED[kind], d, config.p), init_std)
               for j, kind in enumerate(kinds)}
    aux = {"contexts": sample_contexts(config)}
    rec = record_every or max(1, steps // 20)
    with reporter.task("restricted models, exact risk (population engine)", steps) as cb:
        tr = population.gradient_descent(loss_fn, params0, aux, lr=lr, n_steps=steps, optimizer=optax.adam,
                                         record_every=rec, batched=True, record_params=True, callback=cb)
    final = jax.tree_util.tree_map(lambda a: a[:, -1], tr.params)
    out = jax.vmap(risks)(final, aux)
    return tr._replace(params=None), {k: np.asarray(v) / d for k, v in out.items()}
