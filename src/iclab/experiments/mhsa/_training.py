"""The trained setting of mhsa Fig 1, shared by :mod:`~iclab.experiments.mhsa.fig1`,
:mod:`~iclab.experiments.mhsa.length` and the benchmark: its config, the full H-head model's
initialisation from the theory's read-outs, losses, read-outs, Monte Carlo evaluation, the spectral
model (the decomposable weights' balanced per-block factors, :func:`spectral_factors`), and the joint training
of both on shared minibatches.

The full H-head model (eq 2.1: separate K, Q, V, O per head, no residual, mask or positions) is
trained by gradient descent on fresh Gaussian minibatches of the multi-task regression (2.4) with
the ½-MSE (2.6), from the theory's balanced decomposable initialisation (Def 3.1, Thm 3.3) in which
head i has the largest initial μ on task i (h_i* = i).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.engines import Members, seed_keys, train_members
from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._memory import Term, itemsize, records, total
from iclab.models import mhsa as models
from iclab.tasks.multitask_regression import TaskStructure, homogeneous, sample_prompts
from iclab.theory import mhsa as theory

#: Names of the recorded decomposability defects (Def 3.1), each the largest over heads.
DEFECTS = ("UX_over_UY", "WY_over_WX", "WX_offdiag", "UY_offdiag", "WX_block_spread")


class Fig1Config(ExperimentConfig):
    """Settings of mhsa Fig 1's trained models (also the training part of ``mhsa.length``'s config)."""

    H: int = param(3, "heads H", paper=3, ge=1, le=64)
    I: int = param(3, "homogeneous tasks I (d = I·d̄, d_y = I)", paper=3, ge=1, le=64)
    d_bar: int = param(10, "task dimension d̄ = d_i", paper=10, paper_note="d = 30 with I = 3 homogeneous tasks",
                       ge=1, le=1000)
    L: int = param(100, "context length L", paper=100, ge=2, le=100_000)
    lam: float = param(1.0, "signal λ_i of every task (Cov g_i = λ I)", paper=1.0, gt=0, le=1e3)
    sigma: float = param(0.0, "label-noise standard deviation σ", paper=0.0, ge=0, le=1e3)
    d_e: int | None = param(None, "head width d_e (≥ max(d, d_y)); null: d_e = d", paper=None,
                            paper_note="unspecified for Fig 1; Fig 3 uses d_e = 30 = d and says it matches Fig 1",
                            ge=1, le=10_000)
    omega0: float = param(0.01, "initial ω̄ of every head and task (W_X^(h) = ω_0 I)", paper=None,
                          paper_note="unspecified; Fig 3 starts (3.4) at ω̄ = 0.01", gt=0, lt=1)
    mu0: float = param(0.05, "initial μ_0 (U_Y^(h) = μ_0 I, favoured entries × (1 + advantage))", paper=None,
                       paper_note="unspecified", gt=0, le=100)
    advantage: float = param(0.5, "relative head advantage: μ_i^(i)(0) = μ_0(1 + advantage), h_i* = i", paper=None,
                             paper_note="unspecified; the paper only says h_i* = i by initialisation", gt=0, le=100)
    init_noise: float = param(0.0, "std of iid Gaussian noise added to every entry of K, Q, V, O at init", paper=None,
                              paper_note="the theory's init is exactly decomposable (noise 0)", ge=0, le=1)
    rotate: bool = param(False, "Haar-random Φ, Ψ (shared by the seeds), init rotated to match", paper=False,
                         paper_note="Φ = Ψ = I without loss of generality (Sec 2.2)")
    lr: float = param(1.0, "GD learning rate (plain SGD on the ½-MSE)", paper=None,
                      paper_note="optimiser and lr unspecified", gt=0, le=100)
    steps: int = param(1500, "GD steps", paper=None, paper_note="unspecified", ge=1, le=10_000_000)
    batch: int = param(4096, "fresh prompts per step", paper=None, paper_note="unspecified",
                       ge=1, le=1_000_000)
    record_every: int = param(10, "record every this many steps", ge=1, le=1_000_000)
    dtype: Literal["float32", "float64"] = param("float32", "training arithmetic (data, weights, gradients)")
    eval_prompts: int = param(32_768, "fresh prompts of the Monte Carlo loss of the final weights and of (4.3)",
                              ge=1024, le=10_000_000)
    companion_batch_divisor: int = param(4, "k: a second full-model run at batch // k extrapolates the "
                                            "decomposability residue to infinite batch", paper=None,
                                         paper_note="our device: the paper reports no residue", ge=2, le=1024)

    @model_validator(mode="after")
    def _sizes(self):
        if self.H < self.I:
            raise ValueError(f"H must be >= I = {self.I} (got {self.H}): Fig 1's theory needs one head per task")
        if self.d_e is not None and self.d_e < self.I * self.d_bar:
            raise ValueError(f"d_e must be >= d = I·d_bar = {self.I * self.d_bar} (got {self.d_e})")
        if self.batch // self.companion_batch_divisor < 1:
            raise ValueError(f"batch // companion_batch_divisor must be >= 1 (got {self.batch} // "
                             f"{self.companion_batch_divisor})")
        return self


def task_family(config: Fig1Config) -> TaskStructure:
    """Homogeneous tasks of Fig 1 in the training dtype; Φ, Ψ Haar-random if ``rotate``."""
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1_000_003) if config.rotate else None
    ts = homogeneous(config.I, config.d_bar, lam=config.lam, sigma=config.sigma, rotation_key=key)
    dt = jnp.dtype(config.dtype)
    return ts._replace(Phi=ts.Phi.astype(dt), Psi=ts.Psi.astype(dt))


def head_width(config: Fig1Config) -> int:
    """d_e: the config's, or d = I·d̄ when it is null."""
    return config.I * config.d_bar if config.d_e is None else config.d_e


def initial_params(spec, ts: TaskStructure, d_e: int, noise: float = 0.0, key=None):
    """Full weights with read-outs ``spec`` = {"omega", "mu"} (H, I) in the bases Φ, Ψ (Def 3.1).

    The balanced form of :func:`iclab.models.mhsa.spectral_to_full` rotated to the task bases:
    K_X, Q_X ← K_XΦᵀ, Q_XΦᵀ and V_Y ← V_YΨᵀ, O ← ΨO, so that W_X = Φ blockdiag(ω̄_i I)Φᵀ and
    U_Y = Ψ diag(μ)Ψᵀ; then iid N(0, noise²) added to every entry (``key`` needed if noise > 0).
    """
    p = models.spectral_to_full(spec, ts.d_i, ts.d_y, d_e)
    Phi, Psi = ts.Phi.astype(jnp.float64), ts.Psi.astype(jnp.float64)
    rot_in = jax.scipy.linalg.block_diag(Phi, Psi).T  # acts on the token axis D = d + d_y
    p = {"K": p["K"] @ rot_in, "Q": p["Q"] @ rot_in, "V": p["V"] @ rot_in,
         "O": jnp.einsum("ab,hbe->hae", Psi, p["O"])}
    if noise > 0:
        ks = jax.random.split(key, 4)
        p = {k: v + noise * jax.random.normal(kk, v.shape, v.dtype) for (k, v), kk in zip(sorted(p.items()), ks)}
    return {k: v.astype(ts.Phi.dtype) for k, v in p.items()}


def half_mse(params, prompts) -> jax.Array:
    """Training loss (2.6): ½ mean over prompts of ‖ŷ_q − y_q‖²."""
    err = models.predict(params, prompts.X, prompts.Y, prompts.q) - prompts.y_q
    return 0.5 * jnp.mean(jnp.sum(err**2, axis=-1))


def decomposability_defects(params, ts: TaskStructure) -> dict:
    """How far full weights are from decomposable (Def 3.1), each the largest over heads.

    ‖U_X‖/‖U_Y‖ and ‖W_Y‖/‖W_X‖ (condition (i)); relative Frobenius norms of the off-diagonal parts
    of ΦᵀW_XΦ and ΨᵀU_YΨ (condition (ii)); relative spread of diag(ΦᵀW_XΦ) around its block means
    over J_i (condition (iii)). All 0 for decomposable weights.
    """
    WX, WY, UX, UY = models.effective_matrices(params, ts.d)
    WX = jnp.einsum("da,hde,eb->hab", ts.Phi, WX, ts.Phi)
    UY = jnp.einsum("da,hde,eb->hab", ts.Psi, UY, ts.Psi)

    def fro(a):
        return jnp.sqrt(jnp.sum(a**2, axis=(-2, -1)))

    def offdiag(a):
        return fro(a - jnp.eye(a.shape[-1], dtype=a.dtype) * a)

    diag = jnp.diagonal(WX, axis1=1, axis2=2)
    means = models.coordinate_values(models.read_spectral(params, ts.d_i, ts.Phi, ts.Psi)["omega"], ts.d_i)
    out = {"UX_over_UY": fro(UX) / fro(UY), "WY_over_WX": fro(WY) / fro(WX),
           "WX_offdiag": offdiag(WX) / fro(WX), "UY_offdiag": offdiag(UY) / fro(UY),
           "WX_block_spread": jnp.sqrt(jnp.sum((diag - means) ** 2, axis=-1)) / fro(WX)}
    return {k: jnp.max(v) for k, v in out.items()}


def mc_task_errors(params, ts: TaskStructure, L: int, key, n: int, chunk: int = 2048):
    """Per-task squared errors ((Ψᵀ(ŷ_q − y_q))_j², j over the d_y outputs in the task basis), each
    averaged over a chunk of fresh prompts of length L: (n_chunks, d_y) float64, n_chunks = max(n // chunk, 2).
    Their sum over j is ‖ŷ_q − y_q‖² (no ½); chunk means give the Monte Carlo standard errors.
    ``params`` may be a tuple of M weight sets, evaluated on the same prompts: then (M, n_chunks, d_y)."""
    chunk = min(chunk, n)
    n_chunks = max(n // chunk, 2)
    many = isinstance(params, tuple)

    def one(k):
        pr = sample_prompts(k, ts, L, chunk)
        errs = [(models.predict(p, pr.X, pr.Y, pr.q) - pr.y_q) @ ts.Psi for p in (params if many else (params,))]
        out = jnp.stack([jnp.mean(e**2, axis=0) for e in errs])
        return out if many else out[0]

    vals = jax.lax.map(one, jax.random.split(key, n_chunks)).astype(jnp.float64)
    return jnp.moveaxis(vals, 0, 1) if many else vals


def mc_loss(params, ts: TaskStructure, L: int, key, n: int, chunk: int = 2048):
    """E‖ŷ_q − y_q‖² (no ½) by Monte Carlo over n fresh prompts; returns (mean, standard error)."""
    vals = jnp.sum(mc_task_errors(params, ts, L, key, n, chunk), axis=-1)
    return jnp.mean(vals), jnp.std(vals, ddof=1) / jnp.sqrt(vals.shape[0])


def spectral_factors(spec, d_i, d_e: int) -> dict:
    """Balanced per-(head, task) coordinates of the decomposable weights (Lemma 3.2; App. D).

    In :func:`iclab.models.mhsa.spectral_to_full` the block J_i of K_X (and of Q_X) is s_i I_{d_i} with
    s_i = (√d_e ω̄_i)^{1/2}, and V_Y, Oᵀ carry √μ_i on output i. A full GD step moves each diagonal
    entry j ∈ J_i of K_X by −lr ∂L/∂K_jj, and the population gradient is the same on the whole block
    (Prop C.1), so the block moves by the mean −lr (1/d_i) Σ_{j∈J_i} ∂L/∂K_jj. With L written
    as a function of one shared s_i, ∂L/∂s_i = Σ_{j∈J_i} ∂L/∂K_jj: the full step is s_i ← s_i − lr ∂L/∂s_i / d_i,
    which is plain GD on k_i = √d_i s_i = ‖s_i 1_{d_i}‖ (the block's Frobenius norm, the manifold's
    Euclidean coordinate): k_i ← k_i − lr ∂L/∂k_i with ∂L/∂k_i = ∂L/∂s_i / √d_i. Outputs have one
    coordinate per task (d_y = I), so μ's factors σ(O)_i = σ(V_Y)_i = √μ_i need no rescaling.
    Then ω̄_i = k_i q_i/(d_i √d_e) (a step moves it by −2 lr ω̄_i ᾱ_i/√d_e + O(lr²), ᾱ_i the block mean of
    ∂L/∂(W_X)_jj, as in Lemma 3.2's symmetric case) and μ_i = o_i v_i.

    Returns {"k", "q", "o", "v"} (H, I): k = q = √d_i (√d_e ω̄)^{1/2}, o = v = √μ.
    """
    s = jnp.sqrt(jnp.sqrt(d_e) * jnp.asarray(spec["omega"]))
    k = jnp.sqrt(jnp.asarray(d_i, dtype=s.dtype)) * s
    o = jnp.sqrt(jnp.asarray(spec["mu"]))
    return {"k": k, "q": k, "o": o, "v": o}


def factors_to_spectral(f, d_i, d_e: int) -> dict:
    """(ω̄, μ) of balanced factors: ω̄_i = k_i q_i / (d_i √d_e) (W_X = K_XᵀQ_X/√d_e), μ_i = o_i v_i."""
    d_i = jnp.asarray(d_i, dtype=f["k"].dtype)
    return {"omega": f["k"] * f["q"] / (d_i * jnp.sqrt(jnp.asarray(d_e, f["k"].dtype))), "mu": f["o"] * f["v"]}


def spectral_half_loss(factors, X, q, ts: TaskStructure, d_e: int) -> jax.Array:
    """½ E_{G,ε}‖ŷ_q − y_q‖² of the decomposable model (the full model's ½-MSE (2.6) with G and ε
    integrated out, :func:`iclab.models.mhsa.spectral_expected_loss`), on prompts (X, q) given in the
    canonical basis and rotated to the task basis Φ (Gaussian X, q are rotation invariant, Sec 2.2)."""
    Xt = jnp.einsum("da,pdl->pal", ts.Phi, X)
    qt = q @ ts.Phi
    spec = factors_to_spectral(factors, ts.d_i, d_e)
    return 0.5 * models.spectral_expected_loss(spec, Xt, qt, ts.d_i, ts.lam, sigma2=ts.sigma**2)


class Fig1Training(NamedTuple):
    """What :func:`train_fig1` returns: the task family ``ts``, head width ``d_e``, the initial read-outs
    ``omega_init``/``mu_init`` (H, I), the per-seed keys (S, 2), the trajectory of the joint trainer
    (``metrics["member_loss"]["full"]`` (S, T) the full model's ½-MSE; metrics "readout", "defects", and
    "spectral" when the spectral model is trained alongside) and the final full weights ``final`` (each
    leaf with a leading seed axis S)."""

    ts: TaskStructure
    d_e: int
    omega_init: np.ndarray
    mu_init: np.ndarray
    keys: jax.Array
    trajectory: object
    final: dict


def train_fig1(config: Fig1Config, reporter, *, lr=None, batch: int | None = None, data_stream: int = 2,
               spectral: bool = False) -> Fig1Training:
    """Trains the full model by SGD on fresh minibatches for each seed (vmapped), from the theory's init.

    One call of :func:`iclab.engines.train_members`: group "full" (the H-head model, one member per
    seed) and, with ``spectral``, group "spectral" (the balanced factors of the decomposable weights,
    :func:`spectral_factors`) trained by the same GD (lr, steps) on :func:`spectral_half_loss` of the
    same minibatch's (X, q), G and ε integrated out. The joint objective is the sum of the two losses;
    their parameters are disjoint, so GD on the sum is GD on each. Sharing the loop shares the sampling
    of X (most of a step's cost at float32 on a CPU) and the sampling noise of (X, q) (common random
    numbers), and puts both on the same t = Σ lr.

    Keys of seed s (key_s from :func:`iclab.engines.seed_keys`): the init noise uses fold_in(key_s, 1)
    (passed as ``params0``: the theory's init needs no member key), the minibatch of step k
    fold_in(fold_in(key_s, data_stream), k); 3 is left for evaluation, 4 for the companion run at batch // k.
    Records the read-outs (ω̄, μ) and the decomposability defects every ``record_every`` steps, on t = Σ lr.

    Args:
        config: the Fig 1 setting.
        reporter: progress reporter (None: silent).
        lr: a schedule step -> lr replacing ``config.lr`` (None: the constant ``config.lr``).
        batch: prompts per step (None: ``config.batch``).
        data_stream: the fold_in stream of the minibatch keys.
        spectral: also train the spectral model in the same loop (metric "spectral": its (ω̄, μ)).
    Returns:
        :class:`Fig1Training`.
    """
    c = config
    batch = c.batch if batch is None else batch
    ts = task_family(c)
    d_e = head_width(c)
    omega0, mu0 = theory.initial_state(H=c.H, I=c.I, omega0=c.omega0, mu0=c.mu0, advantage=c.advantage)
    spec0 = {"omega": omega0, "mu": mu0}
    keys = seed_keys(c.seed, c.seeds)
    full0 = jax.jit(jax.vmap(lambda k: initial_params(spec0, ts, d_e, c.init_noise, jax.random.fold_in(k, 1))))(keys)

    def sampler(key, _aux):
        return sample_prompts(key, ts, c.L, batch)

    # init=None: the initial params come as params0 (the theory's deterministic init, noise keyed as above).
    groups = {"full": Members(init=None, loss=lambda p, prompts, _s: half_mse(p, prompts), ids=np.array(0))}
    params0 = {"full": full0}
    metrics = {"readout": lambda p, _a: models.read_spectral(p["full"], ts.d_i, ts.Phi, ts.Psi),
               "defects": lambda p, _a: decomposability_defects(p["full"], ts)}
    if spectral:
        groups["spectral"] = Members(
            init=None, ids=np.array(1),
            loss=lambda f, prompts, _s: spectral_half_loss(f, prompts.X, prompts.q, ts, d_e))
        f0 = spectral_factors({k: jnp.asarray(v, ts.Phi.dtype) for k, v in spec0.items()}, ts.d_i, d_e)
        params0["spectral"] = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (c.seeds,) + a.shape), f0)
        metrics["spectral"] = lambda p, _a: factors_to_spectral(p["spectral"], ts.d_i, d_e)

    label = (f"SGD, full {c.H}-head softmax attention{' + spectral model' if spectral else ''} "
             f"(batch {batch}, {c.seeds} seeds)")
    tr = train_members(groups, sampler, keys=keys, lr=c.lr if lr is None else lr, n_steps=c.steps,
                       record_every=c.record_every, metrics=metrics, params0=params0, data_stream=data_stream,
                       reporter=reporter, label=label)
    return Fig1Training(ts, d_e, omega0, mu0, keys, tr, tr.final_params["full"])


def training_memory(config: Fig1Config, *, spectral: bool = False) -> Term:
    """Upper estimate of :func:`train_fig1`'s memory (the larger of the two batches, ``batch``), in the training
    dtype: every seed's step at once (vmapped). Per prompt the covariates X (d, L), the responses and their noise
    (d_y, L), the tokens Z = [X; Y] (D = d + d_y rows), the spectral model's rotated X, and the backward pass's
    contractions of them: XLA holds about 24 (D, L) arrays per prompt in a step (measured: 18 at Fig 1's
    sizes); and per head the (L,) scores and attention of both models. The records hold the read-outs (ω̄, μ)
    of both models (4HI) and the five defects per record and seed."""
    S, B, L, H = config.seeds, config.batch, config.L, config.H
    d, d_y = config.I * config.d_bar, config.I
    per_prompt = L * (24 * (d + d_y) + 6 * H) + (L * 4 * H if spectral else 0)
    return total([(itemsize(config.dtype) * S * B * per_prompt,
                   f"the {B} prompts of (d + d_y)×L = {d + d_y}×{L} tokens of {S} seed(s) and their attention"),
                  (records(seeds=S, steps=config.steps, record_every=config.record_every,
                           values=4 * H * config.I + 10), "the recorded read-outs")])


def monte_carlo_memory(config: Fig1Config, *, L: int, chunk: int, models: int = 1) -> Term:
    """Upper estimate of :func:`mc_task_errors` at length L, vmapped over the seeds: one chunk of prompts per
    seed (X, Y, Z as in :func:`training_memory`, and their products with each weight set: about 8 (D, L) arrays
    per prompt, measured 6) and each of the ``models`` weight sets' (H, L) scores and attention on it."""
    S, H, d, d_y = config.seeds, config.H, config.I * config.d_bar, config.I
    chunk = min(chunk, config.eval_prompts)
    return (float(itemsize(config.dtype) * S * chunk * L * (8 * (d + d_y) + 4 * H * models)),
            f"a chunk of {chunk} Monte Carlo prompts of length {L} × {S} seed(s)")


def winners(mu_init) -> np.ndarray:
    """The head favoured on each task at init, argmax_h μ_i^(h)(0). Returns (I,)."""
    return np.argmax(np.asarray(mu_init), axis=0)
