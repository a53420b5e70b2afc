"""Shared pieces of the drift experiments: the task config, one training entry point for a grid of
GLA models, and their evaluation against the Theorem 2/3 closed forms.

Training (spec §5): AdamW on the mean squared query error, a fresh batch of prompts per step
(``sampled.minibatch``). A whole grid of models, one per (γ, λ) — and per layer count — is trained in
ONE run: their losses are summed and Adam/AdamW act elementwise, so every model follows exactly the
updates it would get alone. All models share each step's random numbers (common random numbers:
one set of inputs and standard normals drives the AR(1) process of every γ), which makes the
sweeps smooth and costs the random numbers of one model.

Evaluation (``model_errors``): a one-layer model with restricted weights (U_11, u_{-1}) is evaluated
EXACTLY, by ``theory.drift.restricted_error`` (its population error in closed form, at any train or
test setting): no Monte Carlo. Any other model is evaluated by Monte Carlo. The MSE of a trained
model on N fresh prompts has a relative standard error of about √(2/N), too coarse for a 3 %
comparison at affordable N. Every such model is therefore evaluated beside
the Theorem 1 optimal predictor (eq 15 / eq 18, ``theory.drift.optimal_prediction``) on the SAME
prompts, and its population error is estimated as

    err ≈ E_theory + mean[(ŷ_model − y)² − (ŷ_opt − y)²],

unbiased because E[(ŷ_opt − y)²] = E_theory (Theorems 2-3); the difference has a small variance
because a trained model predicts nearly what the optimum does. The raw Monte-Carlo errors of both
are kept as well, and the optimal predictor's is checked against the theory (a test of the sampler
and the closed forms that does not involve training).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import field_validator, model_validator

from iclab.engines import sampled
from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments.checks import check_equal
from iclab.models import gla_forget as gla
from iclab.tasks.drift import sample_drift_prompts, tokens
from iclab.theory import drift as theory

PAPER = "drift"
#: The γ values of Fig 1a and of the LMS/RLS table (spec §5).
PAPER_GAMMAS = (0.8, 0.85, 0.925, 0.95, 0.975)
#: Spec §5 table (d = 10, n = 100, σ_w² = 1, σ_e² = 0.01, Λ = I): γ -> (λ*, err(λ*), err(λ = 1)).
#: Derived in the digest [D] from Theorem 2; the paper prints no numbers for Fig 1.
SPEC_TABLE = {
    0.8: (0.7405, 0.24536, 0.27639),
    0.85: (0.7895, 0.30399, 0.35738),
    0.9: (0.8404, 0.41047, 0.51799),
    0.925: (0.8674, 0.50594, 0.67564),
    0.95: (0.8964, 0.67406, 0.97714),
    0.975: (0.9303, 1.08639, 1.70363),
}


class TaskConfig(ExperimentConfig):
    """The drifting-task setting of Figs 1-2 (spec §2, §5)."""

    d: int = param(10, "input dimension d", paper=10, ge=1, le=256)
    n: int = param(100, "labelled context pairs n of a training prompt", paper=100, ge=1, le=10_000)
    sigma_w2: float = param(1.0, "variance σ_w² of w_0", paper=1.0, ge=0, le=1e6)
    sigma_e2: float = param(0.01, "variance σ_e² of the drift increments e_i", paper=0.01, ge=0, le=1e6)
    eigenvalues: list[float] | None = param(
        None, "eigenvalues of the diagonal input covariance Λ (length d); null: Λ = I",
        paper=None, paper_note="unspecified; Λ = I fits the reported LMS/RLS numbers (spec §2)",
    )

    @field_validator("eigenvalues")
    @classmethod
    def _positive(cls, value):
        if value is not None and (len(value) == 0 or any(not (v > 0) for v in value)):
            raise ValueError("eigenvalues must all be > 0")
        return value

    @model_validator(mode="after")
    def _length(self):
        if self.eigenvalues is not None and len(self.eigenvalues) != self.d:
            raise ValueError(f"eigenvalues must have d = {self.d} entries (got {len(self.eigenvalues)})")
        return self

    def Lam(self) -> np.ndarray:
        """Λ, (d, d)."""
        return np.diag(self.eigenvalues) if self.eigenvalues is not None else np.eye(self.d)

    def process(self) -> dict:
        """σ_w², σ_e², n as keyword arguments of the theory functions."""
        return {"sigma_w2": self.sigma_w2, "sigma_e2": self.sigma_e2, "n": self.n}


class TrainConfig(TaskConfig):
    """AdamW training of GLA from a random Gaussian init (spec §5)."""

    batch: int = param(5000, "prompts per step (a fresh batch every step)", paper=5000, ge=1, le=1_000_000)
    steps: int = param(2000, "optimiser steps", paper=2000,
                       paper_note="'2000 epochs, batch 5000' with B = 10⁷ = 2000 × 5000: one step per fresh batch",
                       ge=1, le=10_000_000)
    lr: float = param(1e-2, "AdamW learning rate (peak value of the schedule)", paper=1e-2, gt=0, le=10)
    lr_schedule: Literal["constant", "cosine"] = param(
        "constant", "learning-rate schedule: constant, or cosine decay to 0 over the run",
        paper="constant", paper_note="unspecified; read as constant",
    )
    weight_decay: float = param(0.05, "AdamW (decoupled) weight decay", paper=0.05, ge=0, le=10)
    b1: float = param(0.9, "Adam β1 (the paper's 'momentum')", paper=0.9, ge=0, lt=1)
    b2: float = param(0.999, "Adam β2", paper=None, paper_note="unspecified; the PyTorch/optax default", ge=0, lt=1)
    init_std: float = param(0.1, "std of the random Gaussian init of every weight entry", paper=None,
                            paper_note="unspecified ('random Gaussian init')", gt=0, le=10)
    parametrisation: gla.Parametrisation = param(
        "qkv", "GLA weights trained: qkv (separate W_Q, W_K, W_V), merged (W_V, W^KQ), lemma2 (U), "
        "restricted (U_11, u_-1)", paper="qkv", paper_note="unspecified; the paper's GLA has W_Q, W_K, W_V",
    )
    dtype: Literal["float32", "float64"] = param(
        "float32", "dtype of training (sampling, forward, backward); evaluation is float64",
        paper=None, paper_note="unspecified (PyTorch default float32)",
    )
    n_eval: int = param(20_000, "fresh evaluation prompts per test setting (shared by all models; Monte Carlo "
                        "evaluation only: one-layer restricted weights are evaluated exactly)",
                        paper=None, paper_note="unspecified", ge=100, le=10_000_000)
    record_every: int = param(50, "record the training loss every this many steps", ge=1, le=1_000_000)

    theta_lr_factor: float = param(1.0, "learning rate of a learnt θ (λ = sigmoid(θ)) relative to the weights'",
                                   paper=None, paper_note="extension, not in the paper", gt=0, le=1000)

    def optimizer(self):
        """The optax optimiser factory: AdamW on the weights; a learnt θ (λ = sigmoid(θ)) gets Adam without
        weight decay at ``theta_lr_factor`` times the learning rate."""
        weights = functools.partial(optax.adamw, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
        factor = self.theta_lr_factor

        def make(learning_rate):
            lr_theta = (lambda c: factor * learning_rate(c)) if callable(learning_rate) else factor * learning_rate
            return optax.multi_transform(
                {"w": weights(learning_rate=learning_rate), "theta": optax.adam(lr_theta, b1=self.b1, b2=self.b2)},
                lambda p: jax.tree_util.tree_map_with_path(lambda path, _: "theta" if _is_theta(path) else "w", p))

        return make

    def schedule(self):
        """The learning rate: a float, or an optax schedule of the step."""
        if self.lr_schedule == "cosine":
            return optax.cosine_decay_schedule(self.lr, self.steps)
        return self.lr

    def jnp_dtype(self):
        return jnp.float32 if self.dtype == "float32" else jnp.float64


def _is_theta(path) -> bool:
    return bool(path) and getattr(path[-1], "key", None) == "theta"


def seed_keys(config: ExperimentConfig) -> jax.Array:
    """One key per seed: fold_in(PRNGKey(seed), s), s = 0..seeds−1. Returns (seeds, 2)."""
    base = jax.random.PRNGKey(config.seed)
    return jnp.stack([jax.random.fold_in(base, s) for s in range(config.seeds)])


# --------------------------------------------------------------------------------------------
# Training a grid of models


class Group(NamedTuple):
    """A grid of models trained together: one per (γ_g, λ_gk), all with ``layers`` layers.

    Attributes:
        lams: (G, K) forget factors (for a learnt λ, its initial value).
        layers: None for the one-layer model (fast readout form), L for the L-layer residual GLA.
        learn: None, or a (G, K) boolean mask of the models whose λ = sigmoid(θ) is learnt (extension);
            every model of the group then carries a θ, which the others ignore (zero gradient, no update).
    """

    lams: np.ndarray
    layers: int | None = None
    learn: np.ndarray | None = None


def train_groups(config: TrainConfig, gammas, groups: list[Group], *, eval_set=None, reporter=None,
                 label: str = "", tag: int = 0):
    """Trains every model of every group with AdamW on fresh minibatches, every seed at once.

    All models of a seed see the same batch at every step (common random numbers); their losses are
    summed, and since AdamW acts elementwise every model follows the updates it would get alone.
    Seed s initialises group j with fold_in(key_s, 10 + tag + 1000 j) and draws step k's batch from
    fold_in(fold_in(key_s, 20 + tag), k).

    Args:
        config: training setting.
        gammas: (G,) AR(1) coefficients γ of the training prompts.
        groups: the model grids (see ``Group``).
        eval_set: None, or fixed prompts (Z (G, N, n+1, d+1), y (G, N)) on which every model's MSE is
            recorded (metric ``eval_j`` of group j, (S, T, G, K)), in the training dtype.
        tag: distinguishes the keys of several runs of one experiment.
    Returns:
        (Trajectory, list of final params per group with leading (S, G, K) axes, as float64). The
        Trajectory's ``loss`` is the sum of all models' batch losses; its ``params`` are the recorded
        params (a list per group, leading (S, T, G, K) axes).
    """
    dt = config.jnp_dtype()
    gammas = jnp.asarray(gammas, dt)
    G = gammas.shape[0]
    Lam = jnp.asarray(config.Lam(), dt)
    keys = seed_keys(config)
    specs = []
    for grp in groups:
        lams = jnp.asarray(grp.lams, dt)
        if lams.shape[0] != G:
            raise ValueError(f"a group's lams must have G = {G} rows (got {lams.shape})")
        learn = None if grp.learn is None or not np.any(grp.learn) else jnp.asarray(np.broadcast_to(grp.learn, lams.shape))
        specs.append((lams, grp.layers, learn))

    def init_group(key, lams, layers, learn):
        def one(k, lam):
            p = gla.init_gla(k, config.d, config.parametrisation, config.init_std, layers=layers, dtype=dt)
            if learn is not None:
                p["theta"] = jnp.log(lam / (1 - lam))
            return p

        Gk, K = lams.shape
        p = jax.vmap(one)(jax.random.split(key, Gk * K), lams.reshape(-1))
        return jax.tree_util.tree_map(lambda a: a.reshape((Gk, K) + a.shape[1:]), p)

    @jax.jit
    def init_seed(key):
        return [init_group(jax.random.fold_in(key, 10 + tag + 1000 * j), *spec) for j, spec in enumerate(specs)]

    params0 = jax.vmap(init_seed)(keys)

    def group_mse(params, spec, Z, y):
        lams, layers, learn = spec
        forward = gla.predict if layers is None else gla.predict_multilayer
        used = lams if learn is None else jnp.where(learn, jax.nn.sigmoid(params["theta"]), lams)
        pred = jax.vmap(lambda p_g, Z_g, l_g: jax.vmap(lambda p, lam: forward(p, Z_g, lam))(p_g, l_g))(params, Z, used)
        return jnp.mean((pred - y[:, None, :]) ** 2, axis=-1)

    def draw(key, B):
        pr = sample_drift_prompts(key, Lam, config.n, B, gammas, config.sigma_w2, config.sigma_e2, dt)
        return tokens(pr), pr.target

    def loss_fn(params, batch):
        return sum(jnp.sum(group_mse(p, spec, *batch)) for p, spec in zip(params, specs))

    metrics, aux = {}, None
    if eval_set is not None:
        S = keys.shape[0]
        aux = {"Z": jnp.broadcast_to(jnp.asarray(eval_set[0], dt), (S,) + eval_set[0].shape),
               "y": jnp.broadcast_to(jnp.asarray(eval_set[1], dt), (S,) + eval_set[1].shape)}
        for j, spec in enumerate(specs):
            metrics[f"eval_{j}"] = lambda p, a, j=j, spec=spec: group_mse(p[j], spec, a["Z"], a["y"])
    data_keys = jax.vmap(lambda k: jax.random.fold_in(k, 20 + tag))(keys)
    ctx = reporter.task(label or "train", config.steps) if reporter is not None else contextlib.nullcontext()
    with ctx as cb:
        tr = sampled.minibatch(loss_fn, params0, lambda key, _: draw(key, config.batch), data_keys, aux,
                               lr=config.schedule(), n_steps=config.steps, optimizer=config.optimizer(),
                               record_every=config.record_every, metrics=metrics, batched=True, callback=cb,
                               record_params=True)
    final = jax.tree_util.tree_map(lambda a: jnp.asarray(a[:, -1], jnp.float64), tr.params)
    return tr, final


def train_grid(config: TrainConfig, gammas, lams, *, layers: int | None = None, learn=None, reporter=None,
               label: str = "", tag: int = 0):
    """``train_groups`` with one group: returns (Trajectory, final params with leading (S, G, K) axes)."""
    tr, params = train_groups(config, gammas, [Group(np.asarray(lams), layers, learn)], reporter=reporter,
                              label=label, tag=tag)
    return tr, params[0]


# --------------------------------------------------------------------------------------------
# Evaluation against the optimum


def eval_prompts(config: TaskConfig, key, N: int, gamma, m: int | None = None):
    """N float64 evaluation prompts of length m (default n) at γ (scalar or (G,)): (Z, y)."""
    return _draw(key, jnp.asarray(config.Lam()), config.n if m is None else m, N, jnp.asarray(gamma, jnp.float64),
                 config.sigma_w2, config.sigma_e2)


@functools.partial(jax.jit, static_argnames=("n", "N"))
def _draw(key, Lam, n, N, gamma, sigma_w2, sigma_e2):
    pr = sample_drift_prompts(key, Lam, n, N, gamma, sigma_w2, sigma_e2)
    return tokens(pr), pr.target


@functools.partial(jax.jit, static_argnames=("layers",))
def _model_predictions(params, Z, lams, layers=None):
    """Predictions of models (M, ...) at forget factors lams (M,) on shared prompts Z (N, T, d+1): (M, N)."""
    forward = gla.predict if layers is None else gla.predict_multilayer
    return jax.lax.map(lambda pl: forward(pl[0], Z, pl[1]), (params, lams))


def model_predictions(params, Z, lams, layers: int | None = None) -> np.ndarray:
    """Float64 predictions of M stacked models (leading axis M of params) on prompts Z at lams (M,)."""
    return np.asarray(_model_predictions(params, jnp.asarray(Z), jnp.asarray(lams, jnp.float64), layers=layers))


def error_estimates(y_model, y_opt, y, E_theory) -> dict:
    """Population-error estimates of models evaluated beside the optimal predictor on the same prompts.

    Args:
        y_model: (..., N) predictions of the models; y_opt: (..., N) of the optimal predictor at the
            same forget factor; y: (N,) targets; E_theory: (...) Theorem 2/3 error of the optimum.
    Returns:
        dict of (...) arrays: ``cv`` = E_theory + mean[(ŷ−y)² − (ŷ_opt−y)²] and its standard error
        ``cv_se``; ``raw`` = mean (ŷ−y)²; ``opt`` = mean (ŷ_opt−y)² and ``opt_se``.
    """
    e_m = (np.asarray(y_model) - y) ** 2
    e_o = (np.asarray(y_opt) - y) ** 2
    diff = e_m - e_o
    N = diff.shape[-1]
    return {
        "cv": np.asarray(E_theory) + diff.mean(-1),
        "cv_se": diff.std(-1) / np.sqrt(N),
        "raw": e_m.mean(-1),
        "opt": e_o.mean(-1),
        "opt_se": e_o.std(-1) / np.sqrt(N),
    }


def optimal_predictions(config: TaskConfig, Z, lam_train: float, gamma_train: float, lam_bars) -> np.ndarray:
    """Eq 15/18 predictions of the Theorem 1 optimum trained at (λ, γ), at test-time forget factors λ̄.

    Args:
        Z: (N, T, d+1) prompts; lam_bars: (K,) test-time forget factors.
    Returns:
        (K, N) array.
    """
    D1, D2, D3, _ = theory.D_sums(lam_train, gamma_train, **config.process())
    Lt = theory.Lam_tilde(config.Lam(), D2, D3)
    Z = np.asarray(Z)
    return np.stack([theory.optimal_prediction(Z, float(lb), D1, Lt) for lb in np.atleast_1d(lam_bars)])


def model_errors(config: TaskConfig, params, lam_train, gamma_train: float, lam_eval, E_theory, key, *,
                 gamma_eval: float | None = None, m: int | None = None, layers: int | None = None) -> dict:
    """Population errors of M trained models of one seed on prompts of length m at test-time λ̄.

    One-layer restricted weights: exact, ``theory.drift.restricted_error`` (standard error 0).
    Otherwise: ``config.n_eval`` fresh float64 prompts drawn from ``key``, shared by the M models, and
    the estimate Thm 2/3 + mean[(ŷ−y)² − (ŷ_opt−y)²] of ``error_estimates`` beside the eq-15/18
    optimum trained at the same (λ, γ).

    Args:
        params: one parametrisation with a leading model axis M on every array.
        lam_train: (M,) training forget factors; gamma_train: training γ.
        lam_eval: (M,) forget factors used on the evaluation prompts (λ̄ of eq 18; λ for train error).
        E_theory: (M,) Theorem 2/3 errors of the optimum at these settings.
        gamma_eval: γ̄ of the evaluation prompts (default γ); m: their length (default n).
        layers: None for one layer, L for the L-layer residual GLA.
    Returns:
        dict of (M,) arrays: ``err``, ``err_se``; for Monte Carlo also ``opt``, ``opt_se`` (the
        optimum's raw MSE on the same prompts, a check of sampler and theory).
    """
    lam_train, lam_eval = np.atleast_1d(lam_train), np.atleast_1d(lam_eval)
    gbar = gamma_train if gamma_eval is None else gamma_eval
    mm = config.n if m is None else m
    if layers is None and gla.parametrisation(params) == "restricted":
        err = np.array([theory.restricted_error(np.asarray(params["U11"][i]), float(params["u_m1"][i]), float(lam_eval[i]),
                                                gbar, config.sigma_w2, config.sigma_e2, mm, config.Lam())
                        for i in range(lam_eval.size)])
        return {"err": err, "err_se": np.zeros_like(err)}
    Z, y = eval_prompts(config, key, config.n_eval, gbar, m=mm)
    y_opt = np.stack([optimal_predictions(config, Z, float(lt), gamma_train, [float(le)])[0]
                      for lt, le in zip(lam_train, lam_eval)])
    e = error_estimates(model_predictions(params, Z, lam_eval, layers=layers), y_opt, np.asarray(y), E_theory)
    return {"err": e["cv"], "err_se": e["cv_se"], "opt": e["opt"], "opt_se": e["opt_se"]}


# --------------------------------------------------------------------------------------------
# The rank-one saddle of the full weights


#: A model is on the rank-one route when u12 u21ᵀ carries at least this share of its label routes.
RANK_ONE_SHARE = 0.9


def rank_one_route_share(params) -> np.ndarray:
    """Share of a one-layer GLA's prediction carried by the rank-one route, ‖u12‖‖u21‖ / (‖u12‖‖u21‖ + |u_{-1}|‖U11‖_F).

    Lemma 2's U = [[U11, u12], [u21ᵀ, u_{-1}]] (u12 the x-part of W_V's last row, u21 the label row of W_KᵀW_Q)
    gives the label two routes: Theorem 1's u_{-1} Gᵀ U11 x and the rank-one (u12·G)(u21·x)
    (``theory.drift.rank_one_saddle_errors``). The share is ≈ 0 at Theorem 1's weights and ≈ 1 on the
    rank-one saddle, whatever the error; restricted weights have no second route (0).

    params: one parametrisation (``theta`` ignored) with leading axes (...). Returns (...) array.
    """
    params = {k: v for k, v in params.items() if k != "theta"}
    kind = gla.parametrisation(params)
    lead = np.shape(params["U11" if kind == "restricted" else next(iter(params))])[:-2]
    if kind == "restricted":
        return np.zeros(lead)
    flat = jax.tree_util.tree_map(lambda a: jnp.reshape(a, (-1,) + a.shape[len(lead):]), params)
    WV, WKQ = (np.asarray(a) for a in jax.vmap(gla.merged_weights)(flat))
    d = WV.shape[-1] - 1
    theorem1 = np.abs(WV[:, d, d]) * np.linalg.norm(WKQ[:, :d, :d], axis=(-2, -1))
    rank_one = np.linalg.norm(WV[:, d, :d], axis=-1) * np.linalg.norm(WKQ[:, d, :d], axis=-1)
    return (rank_one / (rank_one + theorem1)).reshape(lead)


def saddle_check(err, E_theory, E_saddle, share, labels, tol: float):
    """Check that every trained model more than ``tol`` above Theorem 2 rests on a rank-one saddle.

    A model off Theorem 2 is explained when its error is within ``tol`` of some E_k
    (``theory.drift.rank_one_saddle_errors``) and ≥ ``RANK_ONE_SHARE`` of its label route is rank-one
    (``rank_one_route_share``); the error alone cannot tell that saddle from ŷ = 0 when the gain is small.

    Args:
        err: (..., M) trained errors (leading seed axes allowed); E_theory: (M,) Theorem 2; E_saddle: (M, d)
        saddle errors; share: like ``err``; labels: M strings naming the models (e.g. "γ = 0.95, λ = 0.6").
    Returns:
        A ``check_equal`` of the number of unexplained models (0 expected).
    """
    err, share = np.asarray(err), np.asarray(share)
    off = np.abs(err / E_theory - 1) > tol
    near = np.min(np.abs(err[..., None] / np.asarray(E_saddle) - 1), axis=-1) <= tol
    on_saddle = off & near & (share >= RANK_ONE_SHARE)
    where = sorted({labels[i] for i in np.nonzero(on_saddle)[-1]})
    return check_equal(
        f"models more than {tol:.0%} above Theorem 2 that are not on a rank-one saddle (count over seeds)",
        int(np.sum(off & ~on_saddle)), 0,
        f"{int(off.sum())} of {off.size} trained models are more than {tol:.0%} above Theorem 2, {int(on_saddle.sum())} "
        f"of them on the rank-one saddle of the full weights (error within {tol:.0%} of E_k = D4 trΛ − D1²μ_k²/Λ̃_k and "
        f"≥ {RANK_ONE_SHARE:.0%} of the label route through u12 u21ᵀ, not Theorem 1's u_-1 U11)"
        + (f": {'; '.join(where)}" if where else "")
        + ". Adam leaves that stationary point only through the product u_-1·U11 (second order), so the paper's "
          "'random Gaussian initialization consistently converges' does not hold for full weights at these settings")
