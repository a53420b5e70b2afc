"""mhsa Fig 1: warm-up, emergence and convergence of multi-head softmax attention on I tasks.

The full H-head model (eq 2.1: separate K, Q, V, O per head, no residual, mask or positions) is
trained by gradient descent on fresh Gaussian minibatches of the multi-task regression (2.4) with
the ½-MSE (2.6), from the theory's balanced decomposable initialisation (Def 3.1, Thm 3.3) in which
head i has the largest initial μ on task i (h_i* = i). Recorded on t = Σ lr: the per-head, per-task
read-outs ω̄_i^(h) (block means of diag ΦᵀW_X^(h)Φ) and μ_i^(h) (diagonal of ΨᵀU_Y^(h)Ψ), how far
the weights are from decomposable, and the training loss. Theory (dashed): the reduced ODE of
spec §5.2 from the same (ω̄, μ) on τ = 2t/d (spec A3), the convergence point (4.3) and GF-ICL (4.1).

Beside it (spec A10): the spectral model (dotted), the decomposable weights' balanced factors trained by
the same GD on the exact-expectation loss, on which the time factor c of t = c·τ is fitted (spec C4);
and a companion full-model run at batch B/k from which the decomposability residue is extrapolated to
population GF, r(B) = a B^{-1/2} + b (spec C3).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.engines import sampled
from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._plot import COLORS, THEORY_STYLE, figure, theory_levels
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_most, check_equal, check_rel
from iclab.experiments.mhsa._common import PAPER, seed_keys
from iclab.models import mhsa as models
from iclab.tasks.multitask_regression import TaskStructure, homogeneous, sample_prompts, target_second_moment
from iclab.theory import mhsa as theory

TIME_LABEL = "t = Σ lr   (reduced time τ = 2t/d)"
#: Names of the recorded decomposability defects (Def 3.1), each the largest over heads.
DEFECTS = ("UX_over_UY", "WY_over_WX", "WX_offdiag", "UY_offdiag", "WX_block_spread")


class Fig1Config(ExperimentConfig):
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
                          paper_note="unspecified (spec A9); Fig 3 starts (3.4) at ω̄ = 0.01", gt=0, lt=1)
    mu0: float = param(0.05, "initial μ_0 (U_Y^(h) = μ_0 I, favoured entries × (1 + advantage))", paper=None,
                       paper_note="unspecified (spec A9)", gt=0, le=100)
    advantage: float = param(0.5, "relative head advantage: μ_i^(i)(0) = μ_0(1 + advantage), h_i* = i", paper=None,
                             paper_note="unspecified; the paper only says h_i* = i by initialisation", gt=0, le=100)
    init_noise: float = param(0.0, "std of iid Gaussian noise added to every entry of K, Q, V, O at init", paper=None,
                              paper_note="the theory's init is exactly decomposable (noise 0)", ge=0, le=1)
    rotate: bool = param(False, "Haar-random Φ, Ψ (shared by the seeds), init rotated to match", paper=False,
                         paper_note="Φ = Ψ = I without loss of generality (Sec 2.2)")
    lr: float = param(1.0, "GD learning rate (plain SGD on the ½-MSE)", paper=None,
                      paper_note="optimiser and lr unspecified (spec §4)", gt=0, le=100)
    steps: int = param(1500, "GD steps", paper=None, paper_note="unspecified", ge=1, le=10_000_000)
    batch: int = param(4096, "fresh prompts per step", paper=None, paper_note="unspecified; spec: ≥ 4096",
                       ge=1, le=1_000_000)
    record_every: int = param(10, "record every this many steps", ge=1, le=1_000_000)
    dtype: Literal["float32", "float64"] = param("float32", "training arithmetic (data, weights, gradients)")
    eval_prompts: int = param(32_768, "fresh prompts of the Monte Carlo loss of the final weights and of (4.3)",
                              ge=1024, le=10_000_000)
    companion_batch_divisor: int = param(4, "k: a second full-model run at batch // k extrapolates the "
                                            "decomposability residue to infinite batch (spec C3)", paper=None,
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
    ts = homogeneous(config.I, config.d_bar, config.lam, config.sigma, rotation_key=key)
    dt = jnp.dtype(config.dtype)
    return ts._replace(Phi=ts.Phi.astype(dt), Psi=ts.Psi.astype(dt))


def head_width(config: Fig1Config) -> int:
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


def rise_time(t, y, level: float) -> float:
    """First time y reaches ``level`` from below, linearly interpolated (NaN if never)."""
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    k = np.flatnonzero(y >= level)
    if k.size == 0:
        return float("nan")
    k = int(k[0])
    if k == 0:
        return float(t[0])
    return float(np.interp(level, y[k - 1:k + 1], t[k - 1:k + 1]))


def spectral_factors(spec, d_i, d_e: int) -> dict:
    """Balanced per-(head, task) coordinates of the decomposable weights (spec §5.1, A10(b)).

    In :func:`iclab.models.mhsa.spectral_to_full` the block J_i of K_X (and of Q_X) is s_i I_{d_i} with
    s_i = (√d_e ω̄_i)^{1/2}, and V_Y, Oᵀ carry √μ_i on output i. A full GD step moves each diagonal
    entry j ∈ J_i of K_X by −lr ∂L/∂K_jj, and the population gradient is the same on the whole block
    (Prop C.1, spec §5.1), so the block moves by the mean −lr (1/d_i) Σ_{j∈J_i} ∂L/∂K_jj. With L written
    as a function of one shared s_i, ∂L/∂s_i = Σ_{j∈J_i} ∂L/∂K_jj: the full step is s_i ← s_i − lr ∂L/∂s_i / d_i,
    which is plain GD on k_i = √d_i s_i = ‖s_i 1_{d_i}‖ (the block's Frobenius norm, the manifold's
    Euclidean coordinate): k_i ← k_i − lr ∂L/∂k_i with ∂L/∂k_i = ∂L/∂s_i / √d_i. Outputs have one
    coordinate per task (d_y = I), so μ's factors σ(O)_i = σ(V_Y)_i = √μ_i need no rescaling.
    Then ω̄_i = k_i q_i/(d_i √d_e) (a step moves it by −2 lr ω̄_i ᾱ_i/√d_e + O(lr²), ᾱ_i the block mean of
    ∂L/∂(W_X)_jj, as in spec §5.1) and μ_i = o_i v_i.

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
    canonical basis and rotated to the task basis Φ (Gaussian X, q are invariant, spec §2.2)."""
    Xt = jnp.einsum("da,pdl->pal", ts.Phi, X)
    qt = q @ ts.Phi
    spec = factors_to_spectral(factors, ts.d_i, d_e)
    return 0.5 * models.spectral_expected_loss(spec, Xt, qt, ts.d_i, ts.lam, ts.sigma**2)


class Fig1Training(NamedTuple):
    """What :func:`train_fig1` returns: the task family ``ts``, head width ``d_e``, the initial read-outs
    ``omega_init``/``mu_init`` (H, I), the per-seed keys (S, 2), the trajectory of the engine (metrics
    "readout", "defects", and "spectral" when the spectral model is trained alongside) and the final
    full weights ``final`` (each leaf with a leading seed axis S)."""

    ts: TaskStructure
    d_e: int
    omega_init: np.ndarray
    mu_init: np.ndarray
    keys: jax.Array
    trajectory: object
    final: dict


def train_fig1(config: Fig1Config, reporter, lr=None, batch: int | None = None, data_fold: int = 2,
               spectral: bool = False) -> Fig1Training:
    """Trains the full model by SGD on fresh minibatches for each seed (vmapped), from the theory's init.

    Seed s uses fold_in(key_s, 1) for the init noise and ``data_fold`` (default 2) for the training
    minibatches (3 is left for evaluation, 4 for the companion run at batch // k). Records the
    read-outs (ω̄, μ) and the decomposability defects every ``record_every`` steps, on t = Σ lr.
    ``lr``: a schedule step -> lr replacing ``config.lr`` (None: the constant ``config.lr``);
    ``batch``: prompts per step (None: ``config.batch``).

    ``spectral``: also train the spectral model of spec A10(b) in the same loop: its balanced factors
    (:func:`spectral_factors`) by the same GD (lr, steps) on :func:`spectral_half_loss` of the same
    minibatch's (X, q), G and ε integrated out. The two parameter sets are disjoint, so GD on the sum of
    the losses is GD on each; sharing the loop shares the sampling of X (most of a step's cost at
    float32 on a CPU) and the sampling noise of (X, q) (common random numbers), and puts both on the
    same t = Σ lr. Its (ω̄, μ) are recorded as metric "spectral"; the recorded loss stays the full model's.
    """
    c = config
    batch = c.batch if batch is None else batch
    ts = task_family(c)
    d_e = head_width(c)
    omega0, mu0 = theory.initial_state(c.H, c.I, c.omega0, c.mu0, c.advantage)
    spec0 = {"omega": omega0, "mu": mu0}
    keys = seed_keys(c.seed, c.seeds)
    params0 = jax.jit(jax.vmap(lambda k: initial_params(spec0, ts, d_e, c.init_noise, jax.random.fold_in(k, 1))))(keys)

    def sampler(key, _aux):
        return sample_prompts(key, ts, c.L, batch)

    metrics = {"readout": lambda p, _a: models.read_spectral(p["full"], ts.d_i, ts.Phi, ts.Psi),
               "defects": lambda p, _a: decomposability_defects(p["full"], ts)}
    params0 = {"full": params0}
    if spectral:
        f0 = spectral_factors({k: jnp.asarray(v, ts.Phi.dtype) for k, v in spec0.items()}, ts.d_i, d_e)
        params0["spectral"] = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (c.seeds,) + a.shape), f0)
        metrics["spectral"] = lambda p, _a: factors_to_spectral(p["spectral"], ts.d_i, d_e)

    def objective(p, prompts):
        loss = half_mse(p["full"], prompts)
        if spectral:
            # + s − stop_gradient(s): the spectral model's gradient, while the value stays the full ½-MSE.
            s = spectral_half_loss(p["spectral"], prompts.X, prompts.q, ts, d_e)
            loss = loss + (s - jax.lax.stop_gradient(s))
        return loss

    data_keys = jax.vmap(lambda k: jax.random.fold_in(k, data_fold))(keys)
    label = (f"SGD, full {c.H}-head softmax attention{' + spectral model' if spectral else ''} "
             f"(batch {batch}, {c.seeds} seeds)")
    with reporter.task(label, c.steps) as cb:
        tr = sampled.minibatch(objective, params0, sampler, data_keys, lr=c.lr if lr is None else lr, n_steps=c.steps,
                               record_every=c.record_every, metrics=metrics, record_params=True, batched=True,
                               callback=cb)
    tr = tr._replace(params=tr.params["full"])
    final = jax.tree_util.tree_map(lambda a: jnp.asarray(a[:, -1]), tr.params)
    return Fig1Training(ts, d_e, omega0, mu0, keys, tr, final)


def run_fig1(config: Fig1Config, reporter) -> dict:
    """Trains the full model for each seed (vmapped) with the spectral model in its loop, then the
    companion full model at batch B/k, and integrates the reduced ODE beside them."""
    c = config
    ts, d_e, omega0, mu0, keys, tr, final = train_fig1(c, reporter, spectral=True)
    d = ts.d
    # Companion run at batch B/k (own minibatches, fold 4): the residue's batch dependence (spec C3).
    companion = train_fig1(c, reporter, batch=c.batch // c.companion_batch_divisor, data_fold=4).trajectory

    w_lim, m_lim = theory.limit_weights(ts.d_i, ts.lam, c.sigma**2, c.L, c.H, omega_off=c.omega0)
    limit = initial_params({"omega": w_lim, "mu": m_lim}, ts, d_e)
    eval_keys = jax.vmap(lambda k: jax.random.fold_in(k, 3))(keys)
    with reporter.task(f"Monte Carlo loss ({c.eval_prompts} prompts per seed)", 2) as cb:
        ev = jax.jit(jax.vmap(lambda p, k: mc_loss(p, ts, c.L, k, c.eval_prompts)))
        final_loss, final_se = ev(final, eval_keys)
        cb(1, {})
        # Same prompts as the trained weights' (paired): the difference is free of most MC noise.
        lim_loss, lim_se = ev(jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (c.seeds,) + a.shape), limit),
                              eval_keys)
        cb(2, {})

    tau = 2.0 * np.asarray(tr.t) / d
    ode = theory.solve_reduced_dynamics(omega0, mu0, tau, ts.d_i, ts.lam, c.sigma**2, c.L, d_e)
    w_star, mu_star = theory.convergence_limit(ts.d_i, ts.lam, c.sigma**2, c.L)
    out = {
        "t": np.asarray(tr.t), "step": np.asarray(tr.step), "loss": np.asarray(tr.loss),
        "omega": np.asarray(tr.metrics["readout"]["omega"]), "mu": np.asarray(tr.metrics["readout"]["mu"]),
        "omega_init": omega0, "mu_init": mu0,
        "ode_tau": tau, "ode_omega": ode.omega_bar, "ode_mu": ode.mu,
        "omega_star": w_star, "mu_star": mu_star,
        "gf_icl": np.float64(theory.gf_icl(ts.d_i, ts.lam, c.sigma**2, c.L)),
        "zero_loss": np.float64(target_second_moment(ts)),
        "final_loss": np.asarray(final_loss), "final_loss_se": np.asarray(final_se),
        "limit_loss": np.asarray(lim_loss), "limit_loss_se": np.asarray(lim_se),
    }
    out.update({f"defect_{k}": np.asarray(v) for k, v in tr.metrics["defects"].items()})
    out.update({f"companion_defect_{k}": np.asarray(v) for k, v in companion.metrics["defects"].items()})
    out.update({"spectral_omega": np.asarray(tr.metrics["spectral"]["omega"]),
                "spectral_mu": np.asarray(tr.metrics["spectral"]["mu"])})
    return out


def winners(mu_init) -> np.ndarray:
    """The head favoured on each task at init, argmax_h μ_i^(h)(0). Returns (I,)."""
    return np.argmax(np.asarray(mu_init), axis=0)


#: Defects of Def 3.1's condition (i) and of (ii)-(iii), the residue of each being the largest of its defects.
CONDITIONS = {"(i)": ("UX_over_UY", "WY_over_WX"), "(ii)-(iii)": ("WX_offdiag", "UY_offdiag", "WX_block_spread")}


#: Fraction of the records, the last ones, whose residues are averaged (:func:`residue`).
RESIDUE_WINDOW = 0.2


def residue(a: dict, condition: str, prefix: str = "") -> float:
    """Decomposability residue r of one condition: the largest of its defects (over heads and the
    condition's defects), averaged over the last ``RESIDUE_WINDOW`` of the records and over seeds
    (``prefix`` "companion_" for the batch-B/k run).

    Why a late-time mean: the residue fluctuates from record to record, the extrapolation amplifies
    that noise (δb = (√k·δr(B) − δr(B/k))/(√k − 1)), and an extreme over records is both noisier and
    biased upwards.
    Measured at the quick preset (4 seeds): the per-seed extrapolated b scatters with s.d. ≈ 0.017 from
    the max over records, ≈ 0.016 from the final record alone and ≈ 0.003 from the mean over the last
    fifth of the records (5 records, 50 steps), whose residue has settled after the emergence peak."""
    r = np.max(np.stack([np.asarray(a[f"{prefix}defect_{n}"]) for n in CONDITIONS[condition]]), axis=0)  # (S, T)
    n = max(1, int(round(RESIDUE_WINDOW * r.shape[1])))
    return float(np.mean(r[:, -n:]))


def population_residue(r_big: float, r_small: float, k: float) -> float:
    """Infinite-batch residue b from residues at batches B and B/k, assuming r(B) = a B^{-1/2} + b
    (minibatch noise of variance ∝ 1/B drives the non-decomposable parts linearly):
    b = (√k r(B) − r(B/k)) / (√k − 1)."""
    sk = np.sqrt(k)
    return float((sk * r_big - r_small) / (sk - 1))


def noise_scaling_deviation(r_big: float, r_small: float, k: float) -> float:
    """|r(B/k) / (√k r(B)) − 1|: 0 for pure minibatch noise (r ∝ B^{-1/2}); 0 if both residues vanish."""
    if r_big == 0 and r_small == 0:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(abs(np.float64(r_small) / (np.sqrt(k) * r_big) - 1))


def checks_fig1(config: Fig1Config, a: dict) -> list:
    c = config
    win = winners(a["mu_init"])  # (I,)
    I = win.size
    tasks = np.arange(I)
    omega_end, mu_end = a["omega"][:, -1], a["mu"][:, -1]  # (S, H, I)
    w_win, m_win = omega_end[:, win, tasks], mu_end[:, win, tasks]  # (S, I)
    loser = np.ones(omega_end.shape[1:], bool)
    loser[win, tasks] = False
    final_argmax = np.argmax(omega_end, axis=1)  # (S, I)
    n_wrong = int(np.sum(final_argmax != win[None]))
    w_star, mu_star = a["omega_star"], a["mu_star"]
    # Spec C3 holds for population GF; the minibatch residue r(B) is extrapolated to B → ∞ from the
    # companion run at B/k (k from the actual batches, in case k does not divide B).
    B, B_small = c.batch, c.batch // c.companion_batch_divisor
    k = B / B_small
    dec = {}
    for cond in CONDITIONS:
        r_big, r_small = residue(a, cond), residue(a, cond, "companion_")
        dec[cond] = (r_big, r_small, population_residue(r_big, r_small, k), noise_scaling_deviation(r_big, r_small, k))
    raw = {cond: f"r(B = {B}) = {v[0]:.4g}, r(B/k = {B_small}) = {v[1]:.4g}, r(B/k)/r(B) = "
                 f"{v[1] / v[0] if v[0] else float('nan'):.3f} vs √k = {np.sqrt(k):.3f}" for cond, v in dec.items()}
    loss = float(np.mean(a["final_loss"]))
    # Emergence: the winner's ω̄ reaches half its limit d_i^{-1/2}; simulation on t, ODE on τ = 2t/d.
    t, tau = a["t"], a["ode_tau"]
    t_sim = np.array([[rise_time(t, a["omega"][s, :, win[i], i], 0.5 * w_star[i]) for i in tasks]
                      for s in range(a["omega"].shape[0])])
    t_ode = np.array([rise_time(t, a["ode_omega"][:, win[i], i], 0.5 * w_star[i]) for i in tasks])
    # Spec C4: fit t = c·τ on the spectral model (A10(b), no minibatch noise from G): the c minimising the
    # squared log-mismatch of the emergence times, c_fit = exp mean log(t_spec/τ_ODE) over tasks and seeds.
    t_spec = np.array([[rise_time(t, a["spectral_omega"][s, :, win[i], i], 0.5 * w_star[i]) for i in tasks]
                       for s in range(a["spectral_omega"].shape[0])])
    tau_ode = np.array([rise_time(tau, a["ode_omega"][:, win[i], i], 0.5 * w_star[i]) for i in tasks])
    c_fit = float(np.exp(np.mean(np.log(t_spec / tau_ode[None]))))
    d = c.I * c.d_bar
    return [
        check_at_most("decomposability (i), population limit: (√k r(B) − r(B/k))/(√k − 1) of r = max ‖U_X‖/‖U_Y‖, "
                      "‖W_Y‖/‖W_X‖ over heads (mean over the last fifth of the records and seeds)", dec["(i)"][2], 1e-2,
                      f"spec C3: population GF keeps U_X = W_Y = 0 exactly; raw {raw['(i)']}"),
        check_at_most("decomposability (ii)-(iii), population limit: (√k r(B) − r(B/k))/(√k − 1) of r = max relative "
                      "off-diagonal of ΦᵀW_XΦ, ΨᵀU_YΨ and spread of diag ΦᵀW_XΦ within blocks", dec["(ii)-(iii)"][2],
                      1e-2, f"spec C3 ('nearly diagonal'), same 1e-2 as (i); raw {raw['(ii)-(iii)']}"),
        check_at_most("decomposability residue is minibatch noise: max over (i), (ii)-(iii) of |r(B/k)/(√k r(B)) − 1|",
                      max(v[3] for v in dec.values()), 0.3,
                      "r ∝ B^{-1/2} within 30 % (r(B/k)/r(B) in [0.7√k, 1.3√k]) licenses the extrapolation; "
                      f"(i): {raw['(i)']}; (ii)-(iii): {raw['(ii)-(iii)']}"),
        check_equal("task allocation: tasks whose final argmax_h ω̄_i^(h) ≠ initial argmax_h μ_i^(h) (all seeds)",
                    n_wrong, 0, "spec C5 / Thm 3.3: each task is won by the head with the largest initial μ"),
        check_at_most("losers: max ω̄_i^(h)/ω_0 over h ≠ h_i*", float(np.max(omega_end[:, loser]) / c.omega0), 2.0,
                      "spec C5: non-optimal heads keep ω̄ = O(ω_0) (Thm 3.3(i))"),
        check_at_most("losers: max |μ_i^(h)|/μ_i* over h ≠ h_i*",
                      float(np.max((np.abs(mu_end) / m_win[:, None, :])[:, loser])), 1e-2,
                      "spec C5: μ_i^(h) ≤ μ_i* e^{−Ω(√d_e)} (Thm 3.3(i))"),
        check_at_most("winners converge to (4.3): max |ω̄_i*√d_i − 1| (tasks, seeds)",
                      float(np.max(np.abs(w_win / w_star - 1))), 0.05, "spec C6: 5 %"),
        check_at_most("winners converge to (4.3): max |μ_i*(1 + e d_iφ_i/L)/√d_i − 1| (tasks, seeds)",
                      float(np.max(np.abs(m_win / mu_star - 1))), 0.05, "spec C6: 5 %"),
        check_rel("converged loss E‖ŷ−y‖² (Monte Carlo, mean over seeds) vs GF-ICL (4.1)", loss, float(a["gf_icl"]),
                  0.15, "spec C7: 15 % at L = 100; (4.1) drops O(L^{-(1-ε)/2}) terms, so the exact loss sits a few "
                        "per cent above it (spec §9)"),
        check_at_most("emergence time: max |t_sim/t_ODE − 1| at ω̄_i* = ½d_i^{-1/2}, ODE on t = (d/2)τ",
                      float(np.max(np.abs(t_sim / t_ode[None] - 1))), 0.10,
                      "spec C4: 10 %; the time factor d/2 is derived (spec A3), not fitted"),
        check_rel("time factor c_fit of t = c·τ, fitted on the spectral model's emergence times, vs d/2",
                  c_fit, d / 2, 0.10,
                  f"spec C4: expected d/2 = {d / 2:g} (spec A3; the paper's 't ← 2dt' would give 2d = {2 * d}); "
                      f"per-task t_spec/τ_ODE = {np.array2string(np.mean(t_spec, axis=0) / tau_ode, precision=4)}"),
    ]


def plot_fig1(config: Fig1Config, a: dict):
    c = config
    fig, axes = figure(ncols=4, width=4.0, height=3.4)
    ax_w, ax_m, ax_l, ax_f = axes[0]
    t = a["t"]
    win = winners(a["mu_init"])
    H, I = a["mu_init"].shape
    seed = 0
    for h in range(H):
        for i in range(I):
            star = win[i] == h
            style = dict(color=COLORS[h], lw=1.6 if star else 0.8, alpha=1.0 if star else 0.6)
            lab = f"head {h + 1}" if i == (list(win).index(h) if h in win else 0) else None
            ax_w.plot(t, a["omega"][seed, :, h, i], label=lab, **style)
            ax_m.plot(t, a["mu"][seed, :, h, i], label=lab, **style)
            ax_w.plot(t, a["ode_omega"][:, h, i], color=COLORS[h], ls="--", lw=0.8)
            ax_m.plot(t, a["ode_mu"][:, h, i], color=COLORS[h], ls="--", lw=0.8)
            ax_w.plot(t, a["spectral_omega"][seed, :, h, i], color=COLORS[h], ls=":", lw=1.2)
            ax_m.plot(t, a["spectral_mu"][seed, :, h, i], color=COLORS[h], ls=":", lw=1.2)
    theory_levels(ax_w, [float(a["omega_star"][0])], ["d̄^{-1/2} (4.3)"])
    theory_levels(ax_m, [float(a["mu_star"][0])], ["(4.3)"])
    ax_w.set_ylabel("ω̄_i^(h)  (eigenvalue of W_X^(h))")
    ax_m.set_ylabel("μ_i^(h)  (eigenvalue of U_Y^(h))")
    ax_w.set_title("ω̄: thick = h_i*, thin = others; dashed = ODE, dotted = spectral model", fontsize=8)
    ax_m.set_title("μ: colour = head, all tasks", fontsize=8)
    for s, curve in enumerate(np.atleast_2d(a["loss"])):
        ax_l.plot(t, curve, color=COLORS[0], lw=1.0, alpha=0.8, label=f"{c.seeds} seeds" if s == 0 else None)
    theory_levels(ax_l, [float(a["zero_loss"]) / 2, float(a["gf_icl"]) / 2], ["½E‖y‖² (ŷ = 0)", "½ GF-ICL (4.1)"])
    ax_l.set_ylabel(f"training loss ½‖ŷ − y‖² (batch {c.batch})")
    ax_l.set_yscale("log")
    for ax in (ax_w, ax_m, ax_l):
        ax.set_xlabel(TIME_LABEL, fontsize=8)
    ax_w.legend(fontsize=7)
    final = a["omega"][:, -1].mean(axis=0)  # (H, I)
    width = 0.8 / H
    for h in range(H):
        ax_f.bar(np.arange(I) + (h - (H - 1) / 2) * width, final[h], width, color=COLORS[h], label=f"head {h + 1}")
    ax_f.axhline(float(a["omega_star"][0]), **THEORY_STYLE)
    ax_f.set_xticks(np.arange(I), [f"task {i + 1}" for i in range(I)])
    ax_f.set_ylabel("final ω̄_i^(h)")
    ax_f.legend(fontsize=7)
    fig.suptitle(f"mhsa Fig 1: H = {H}, I = {I}, d = {I * c.d_bar}, L = {c.L}, λ = {c.lam:g}, σ = {c.sigma:g}, "
                 f"d_e = {head_width(c)}; SGD lr {c.lr:g}, batch {c.batch}; final loss {np.mean(a['final_loss']):.4f} "
                 f"vs GF-ICL {float(a['gf_icl']):.4f} (no ½)", fontsize=9)
    return fig


register(
    Experiment(
        id="mhsa.fig1",
        title="Warm-up, emergence and convergence of multi-head softmax attention: one head per task",
        paper=PAPER,
        reference="Fig 1; Def 3.1, Thm 3.3, (4.1), (4.3); spec §5.2 reduced ODE",
        config=Fig1Config,
        presets={
            "quick": {"batch": 1024, "lr": 2.0, "steps": 230, "omega0": 0.03, "mu0": 0.1,
                      "eval_prompts": 4096},
            "paper": {"lr": 1.0, "steps": 800, "advantage": 1.0},
        },
        run=run_fig1,
        checks=checks_fig1,
        plot=plot_fig1,
        notes=[
            "Unspecified in the paper (spec A9), our choices: plain GD (SGD) with a constant lr on fresh Gaussian "
            "minibatches (batch 4096 at `paper`), ½-MSE (2.6), float32 (the data, weights and gradients); d_e = d "
            "(Fig 3's d_e = 30); Φ = Ψ = I; the theory's balanced decomposable init (Thm 3.3) with W_X^(h) = ω_0 I "
            "and U_Y^(h) = μ_0 I, the entry (h = i, task i) raised by (1 + advantage) so that h_i* = i.",
            "Time: t = Σ lr. The reduced ODE (spec §5.2, dashed) runs on τ = 2t/d, the factor derived for the ½-MSE "
            "(spec A3; the paper's 't ← 2dt' is inconsistent); it is not fitted in the plot or in the full model's "
            "emergence-time check. Spec C4's fit t = c·τ is done on the spectral model (below): c_fit = exp mean "
            "log(t_spec/τ_ODE) of the winners' emergence times (ω̄ at ½ d_i^{-1/2}); quick preset: c_fit = 15.43 vs "
            "d/2 = 15 (+2.9 %, 15.41-15.46 per task, 1 and 4 seeds), far from the paper's 2d = 60.",
            "Spectral model (spec A10(b), dotted): the balanced factors of the decomposable weights, one per (head, "
            "task block) and matrix, trained by the same GD (lr, steps) on ½ of the exact-expectation loss (G and ε "
            "integrated out) of the full model's own minibatch (X, q), in the same loop. The block factor is the "
            "block's Frobenius norm k_i = √d_i s_i, so that GD on it is the full model's GD restricted to decomposable "
            "weights (a shared s_i would move d_i times too fast); a unit test checks one step against the full model "
            "on a batch whose task vectors integrate G out exactly (agreement to O(lr²)). Its (ω̄, μ) follow the full "
            "model's within the line width in the quick preset.",
            "Loss values in the checks are E‖ŷ − y‖² without the ½ (the paper's (4.1) convention, spec A1); the "
            "plotted training loss is the ½-MSE of the next minibatch. The converged loss is Monte Carlo over "
            "`eval_prompts` fresh prompts; the same prompts give the loss of the (4.3) weights for comparison.",
            "At d_i = 10, L = 100 the exact softmax loss is minimised within 0.2 % of (4.3) (ω̄√d_i ≈ 1.006, "
            "μ ≈ 2.483, our Monte Carlo), but its value (≈ 0.233) sits ≈ 9 % above GF-ICL (4.1) = 0.214, the "
            "O(L^{-(1-ε)/2}) terms (4.1) drops. At d_i = 6, L = 60 the optimum is 6 % off (4.3), so the quick "
            "preset keeps the paper's d and L and shrinks the batch and the plateau (larger ω_0, μ_0) instead.",
            "Finding: the (4.3) point is a saddle of the full-parameter loss. For fixed ω̄ at (4.3) the loss is "
            "minimised by negative loser μ (≈ −0.69, loss 0.180 < 0.214 by E.24), which balanced GF cannot reach "
            "(μ = σ(O)σ(V_Y) ≥ 0 while σ(O)² − σ(V_Y)² = 0 is conserved). Minibatch noise breaks the balance, and "
            "after convergence the losers' μ grow negative exponentially (e-fold time ≈ 50 in t at batch 512). "
            "The checks therefore look at the end of a run that stops when the ODE has nearly converged (τ ≈ 30 "
            "quick, 53 paper), inside the window of Thm 3.3(iii); longer runs leave (4.3). Measured at the paper "
            "settings (batch 4096, advantage 1): the losers' |μ|/μ_i* falls to 3e-4 at step 650, then grows (e-fold "
            "≈ 55 in t) through 0.0027 at step 800 to 0.056 at step 1000, while the ODE and the spectral model keep "
            "decaying (5e-6 at step 1000).",
            "Paper preset init: advantage 1 (the favoured head starts with twice the others' μ), not 0.5. The reduced "
            "ODE itself (no sampling) lifts the losers' ω̄ during emergence to 2.37 ω_0 from (ω_0, μ_0, advantage) = "
            "(0.01, 0.05, 0.5) and brings them back under spec C5's 2 ω_0 only at τ ≈ 57, after the minibatch "
            "escape above has begun, so at that init no run length passes both loser checks with margin (1000 "
            "steps: losers' μ 0.027; 900: losers' ω̄ 2.00 ω_0). With advantage 1 the ODE's losers peak at 1.81 ω_0 "
            "and the winners are within 2 % of (4.3) by τ ≈ 47; Thm 3.3 asks only for a Θ(1) relative gap ε. "
            "`--set advantage=0.5 --set steps=1000` is the earlier setting.",
            "Decomposability under minibatch noise: the relative non-decomposable parts (U_X, W_Y, off-diagonal and "
            "within-block spread of W_X) are noise-driven and scale like batch^{-1/2} (max over records 0.112/0.124 "
            "at batch 512, 0.084/0.086 at batch 1024 in the quick setting), so spec C3's 1e-2, a statement about "
            "population GF, would need batches of order 10⁵ if applied to the raw residue. We test it on the "
            "population limit instead: a companion full-model run at batch B/k (k = companion_batch_divisor, own "
            "minibatches) and r(B) = a B^{-1/2} + b give b = (√k r(B) − r(B/k))/(√k − 1), checked ≤ 1e-2, with a "
            "check that r(B/k)/r(B) is within 30 % of √k (the noise law that licenses the extrapolation). r is the "
            "mean over the last fifth of the records and the seeds: the per-seed b then scatters by s.d. ≈ 0.003 "
            "(vs ≈ 0.016 from the final record alone, ≈ 0.017 from the max over records; 4 seeds measured). Quick "
            "preset, seed 0: r(1024) = 0.038 / 0.073, r(256) = 0.074 / 0.154 for (i) / (ii)-(iii), ratios "
            "1.95 / 2.12 vs √k = 2, b = +0.002 / −0.008 (base seed 1: ratios 1.82 / 2.11, b = +0.007 / −0.008). "
            "With 4 seeds b = +0.004 / −0.006; the negative (ii)-(iii) "
            "value says the B^{-1/2} law holds to ≈ 5 %, so b is resolved to about ±0.01, the size of the tolerance: "
            "the check rules out a population residue well above 1e-2, not one of a few 1e-3.",
        ],
        runtime={"quick": "25 s on the idle 2-core machine (75.5 s at load average 1.1-1.7, 129 s at load 2.3-3.0); "
                          "11/11 checks at base seed 0. Base seed 1: 10/11, the converged-loss check (C7) fails "
                          "narrowly (0.2465 vs ≤ 0.2458), as it did before the spectral model and companion were "
                          "added (same full-model trajectory). Three trainings: full model + spectral model in one "
                          "loop (batch 1024, 230 steps) and the companion full model at batch 256",
                 "paper": "267 s (base seed 0) and 246 s (base seed 1) on the idle 2-core machine; 11/11 checks at "
                          "both: winners within 1.3 % (ω̄) and 1.5-1.7 % (μ) of (4.3), losers' μ/μ_i* 0.0027 / 0.0010 "
                          "and ω̄/ω_0 1.61 / 1.60, converged loss 0.235 / 0.237 vs GF-ICL 0.214, emergence "
                          "within 1.6 / 1.8 % of the ODE, c_fit = 15.25 / 15.23 vs d/2 = 15"},
    )
)
