"""Shared pieces of the drift experiments: the task config, one training entry point for a grid of
GLA models, and their evaluation against the Theorem 2/3 closed forms.

Training (the paper's Sec 5 settings): AdamW on the mean squared query error, a fresh batch of prompts per step, through
the joint trainer :func:`iclab.engines.train_members`. A whole grid of models, one per (γ, λ) — and
per layer count, one :class:`~iclab.engines.Members` group each — is trained in ONE run: their losses
are summed and Adam/AdamW act elementwise, so every model follows exactly the updates it would get
alone. All models share each step's random numbers (common random numbers: one set of inputs and
standard normals drives the AR(1) process of every γ), which makes the sweeps smooth and costs the
random numbers of one model. Model m of seed s is initialised from fold_in(fold_in(key_s, 1), m)
(its own key: a model trained alone starts where it starts in the grid).

The backend (a run option, ``iclab run --backend``; :func:`iclab.engines.backend`): with ``xla`` all of this
computes in XLA; with ``native`` (the default on a CPU) the training batches are drawn by the compiled sampler
``tasks.drift.sample_training_batch`` (the same process from another generator, Philox with Box-Muller normals,
so other numbers) and the models run through the compiled kernels of :mod:`iclab.ops` (the XLA forms' values to
float rounding). XLA:CPU reaches a few per cent of a CPU's matmul peak on these small products (T = 101 tokens
of width 11, batched over 5000 prompts); ``iclab bench drift`` measures both.

Evaluation (``model_errors``): a one-layer model with restricted weights (U_11, u_{-1}) is evaluated
EXACTLY, by ``theory.drift.restricted_error`` (its population error in closed form, at any train or
test setting): no Monte Carlo. Any other model is evaluated by Monte Carlo. The MSE of a trained
model on N fresh prompts has a relative standard error of about √(2/N), too coarse for a 3 %
comparison at affordable N. Every such model is therefore evaluated beside
the Theorem 1 optimal predictor (eq 15 / eq 18, ``theory.drift.optimal_prediction``) on the SAME
prompts, and its population error is estimated as

    err ≈ E_theory + mean[(ŷ_model − y)² − (ŷ_opt − y)²]

(``iclab.experiments._analysis.control_variate_risk``), unbiased because E[(ŷ_opt − y)²] = E_theory
(Theorems 2-3); the difference has a small variance because a trained model predicts nearly what the
optimum does. The raw Monte-Carlo error of the optimum is kept as well and checked against the theory
(a test of the sampler and the closed forms that does not involve training).
"""

from __future__ import annotations

import functools
from typing import Literal, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import model_validator

from iclab import baselines
from iclab.engines import Members, backend, seed_keys, train_members
from iclab.experiments._analysis import control_variate_risk
from iclab.experiments._config import ExperimentConfig, TrainingConfig, param, validate_eigenvalues
from iclab.experiments._memory import FLOAT64, Term, itemsize, records
from iclab.experiments.checks import check_equal
from iclab.models import gla_forget as gla
from iclab.tasks.drift import sample_drift_prompts, tokens
from iclab.tasks.drift import sample_shared_batch, sample_training_batch
from iclab.theory import drift as theory

PAPER = "drift"
#: How the GLA models run in training: the backend in force (:func:`iclab.engines.backend`).
Kernel = Literal["xla", "native"]
#: The compiled sampler's standard normals (``tasks.drift.NORMALS``): Box-Muller (one LLVM IR kernel over lanes of
#: 4 prompts: Philox words, ln, cos and sin by polynomials to a few ulp, the tail beyond 6.66 σ (mass 2.7e-11)
#: cut), straight-line vector code, faster per core than the sampler's exact ziggurat.
NORMALS = "box_muller"
#: The γ values of Fig 1a and of the paper's LMS/RLS table.
PAPER_GAMMAS = (0.8, 0.85, 0.925, 0.95, 0.975)
#: Reference table (d = 10, n = 100, σ_w² = 1, σ_e² = 0.01, Λ = I): γ -> (λ*, err(λ*), err(λ = 1)), Theorem 2
#: minimised over λ, computed independently of iclab.theory.drift (tests/theory/test_drift.py holds the theory to
#: it); the paper prints no numbers for Fig 1.
SPEC_TABLE = {
    0.8: (0.7405, 0.24536, 0.27639),
    0.85: (0.7895, 0.30399, 0.35738),
    0.9: (0.8404, 0.41047, 0.51799),
    0.925: (0.8674, 0.50594, 0.67564),
    0.95: (0.8964, 0.67406, 0.97714),
    0.975: (0.9303, 1.08639, 1.70363),
}


class TaskConfig(ExperimentConfig):
    """The drifting-task setting of Figs 1-2 (eqs 2-4, 17; Sec 5)."""

    d: int = param(10, "input dimension d", paper=10, ge=1, le=256)
    n: int = param(100, "labelled context pairs n of a training prompt", paper=100, ge=1, le=10_000)
    sigma_w2: float = param(1.0, "variance σ_w² of w_0", paper=1.0, ge=0, le=1e6)
    sigma_e2: float = param(0.01, "variance σ_e² of the drift increments e_i", paper=0.01, ge=0, le=1e6)
    eigenvalues: list[float] | None = param(
        None, "eigenvalues of the diagonal input covariance Λ (length d); null: Λ = I",
        paper=None, paper_note="unspecified; Λ = I fits the reported LMS/RLS numbers",
    )

    @model_validator(mode="after")
    def _eigenvalues(self):
        validate_eigenvalues(self.eigenvalues, self.d, "d")
        return self

    def Lam(self) -> np.ndarray:
        """Λ, (d, d)."""
        return np.diag(self.eigenvalues) if self.eigenvalues is not None else np.eye(self.d)

    def process(self) -> dict:
        """σ_w², σ_e², n as keyword arguments of the theory functions and the sampler."""
        return {"sigma_w2": self.sigma_w2, "sigma_e2": self.sigma_e2, "n": self.n}

    def setting(self, gamma) -> dict:
        """The training setting at γ, ``gamma, sigma_w2, sigma_e2, n, Lam``, as keyword arguments of
        ``theory.drift`` (``train_error(lam, **config.setting(γ))``)."""
        return {"gamma": gamma, **self.process(), "Lam": self.Lam()}

    def test_setting(self, gamma_bar, m: int) -> dict:
        """A Theorem 3 test setting at γ̄ and length m with the training σ_w², σ_e² (the figures' choice: the
        paper leaves the test σ's unspecified), as keyword arguments of ``theory.drift.test_error``."""
        return {"gamma_bar": gamma_bar, "sigma_w2_bar": self.sigma_w2, "sigma_e2_bar": self.sigma_e2, "m": m}


class TrainConfig(TaskConfig, TrainingConfig):
    """AdamW training of GLA from a random Gaussian init (Sec 5)."""

    batch: int = param(5000, "prompts per step (a fresh batch every step)", paper=5000, ge=1, le=1_000_000)
    steps: int = param(2000, "optimiser steps", paper=2000,
                       paper_note="'2000 epochs, batch 5000' with B = 10⁷ = 2000 × 5000: one step per fresh batch",
                       ge=1, le=10_000_000)
    lr: float = param(1e-2, "learning rate (peak value of the schedule)", paper=1e-2, gt=0, le=10)
    lr_schedule: Literal["constant", "cosine"] = param(
        "constant", "learning-rate schedule: constant, or cosine decay to 0 over the run",
        paper="constant", paper_note="unspecified; read as constant",
    )
    optimizer: Literal["gd", "adam", "adamw"] = param(
        "adamw", "optimiser of the weights: plain GD, Adam, or AdamW (decoupled weight decay)", paper="adamw")
    weight_decay: float = param(0.05, "AdamW (decoupled) weight decay (optimizer adamw only)", paper=0.05, ge=0, le=10)
    b1: float = param(0.9, "Adam β1 (the paper's 'momentum')", paper=0.9, ge=0, lt=1)
    b2: float = param(0.999, "Adam β2", paper=None, paper_note="unspecified; the PyTorch/optax default", ge=0, lt=1)
    dtype: Literal["float32", "float64"] = param(
        "float32", "dtype of training (sampling, forward, backward); evaluation is float64",
        paper=None, paper_note="unspecified (PyTorch default float32)",
    )
    init_std: float = param(0.1, "std of the random Gaussian init of every weight entry", paper=None,
                            paper_note="unspecified ('random Gaussian init')", gt=0, le=10)
    parametrisation: gla.Parametrisation = param(
        "qkv", "GLA weights trained: qkv (separate W_Q, W_K, W_V), merged (W_V, W^KQ), lemma2 (U), "
        "restricted (U_11, u_-1)", paper="qkv", paper_note="unspecified; the paper's GLA has W_Q, W_K, W_V",
    )
    n_eval: int = param(20_000, "fresh evaluation prompts per test setting (shared by all models; Monte Carlo "
                        "evaluation only: one-layer restricted weights are evaluated exactly)",
                        paper=None, paper_note="unspecified", ge=100, le=10_000_000)
    record_every: int = param(50, "record the training loss every this many steps", ge=1, le=1_000_000)

    theta_lr_factor: float = param(1.0, "learning rate of a learnt θ (λ = sigmoid(θ)) relative to the weights'",
                                   paper=None, paper_note="extension, not in the paper", gt=0, le=1000)

    def transformation(self) -> optax.GradientTransformation:
        """The update direction without learning rate: ``optimizer`` (AdamW: Adam plus decoupled weight decay) on
        the weights; a learnt θ (λ = sigmoid(θ)) gets the same direction without weight decay, scaled by
        ``theta_lr_factor`` (so its learning rate is that factor times the weights')."""
        theta = optax.scale(self.theta_lr_factor)
        if self.optimizer != "gd":
            theta = optax.chain(optax.scale_by_adam(b1=self.b1, b2=self.b2), theta)
        return optax.multi_transform({"w": super().transformation(), "theta": theta}, _theta_labels)


def _theta_labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "theta" if path and getattr(path[-1], "key", None) == "theta" else "w", params)


# --------------------------------------------------------------------------------------------
# Training a grid of models


class Group(NamedTuple):
    """A grid of models trained together: one per (γ_g, λ_gk), all with ``layers`` layers.

    Attributes:
        lams: (G, K) forget factors (for a learnt λ, its initial value).
        layers: None for the one-layer model (fast readout form), L for the L-layer residual GLA.
        learn: None, or a (G, K) boolean mask of the models whose λ = sigmoid(θ) is learnt (extension);
            every model of the group then carries a θ, which the others ignore (zero gradient, no update).
        ids: None (the models are numbered after those of the groups before, row-major), or (G, K) distinct
            member ids: they alone fix each model's init key, so a model given its id in a grid starts, and
            trains, as it does inside that grid.
    """

    lams: np.ndarray
    layers: int | None = None
    learn: np.ndarray | None = None
    ids: np.ndarray | None = None


def _forget_factors(params, settings):
    """Each member's λ: its setting, or sigmoid(θ) where it is learnt."""
    if "learn" not in settings:
        return settings["lam"]
    return jnp.where(settings["learn"], jax.nn.sigmoid(params["theta"]), settings["lam"])


#: Whether one-layer models on the shared layout in float32 run the fused loss kernel
#: (``gla_forget.readout_mse_shared``: loss and gradients in one pass, nothing per prompt written) instead
#: of the read-out kernel ``readout_grid_shared`` and XLA's contractions of its residuals (its naive twin; equal to
#: float32 rounding, not bit for bit): no per-prompt residuals are written and read back.
FUSED_READOUT = True


class SharedTokens(NamedTuple):
    """A batch's tokens in the compiled sampler's shared layout (``tasks.drift.sample_shared_batch``):
    z_gbt = (x_bt, y_gbt), the inputs shared by the G rows.

    Attributes:
        x: (B, T, d) inputs; y: (G, B, T) labels, the query's 0.
    """

    x: jax.Array
    y: jax.Array


def _group_mse(layers: int | None, form: gla.Form | None = None, kernel: Kernel = "xla", fused: bool | None = None):
    """The loss of a group: each member's MSE on the batch of its own γ, (G, K).

    Members of row g share the prompts of γ_g: the loss is vmapped over the G rows with the batch mapped, then
    over the K members of a row with the batch shared. One-layer models are read out at the query: by XLA
    (``kernel = "xla"``: ``gla_forget.gla_readout`` vmapped) or by the compiled kernel
    ``gla_forget.readout_grid`` over the whole (G, K) grid at once (``"native"``; on a batch of
    ``SharedTokens``, ``readout_grid_shared``, which train_groups draws where every group is one-layer and both
    sampler and kernel are native; in float32 the fused loss kernel ``readout_mse_shared`` unless ``fused`` (default
    ``FUSED_READOUT``) is False). An L-layer model's full
    layers run in ``form`` (default: ``parallel`` for xla); with kernel ``native`` (and form None or ``native``)
    each L-layer model's whole loss and gradient is one host call, ``gla_forget.multilayer_mse_native`` (the
    layer and read-out kernels, no (B, T, D) tokens crossing between XLA and the host per layer); kernel xla with
    form ``native`` runs each full layer by its kernel from XLA. All are equal to float rounding (tests compare
    them).
    """
    if layers is None and kernel == "native":
        def native(params, batch, settings):
            Z, y = batch
            WV, WKQ = jax.vmap(jax.vmap(gla.merged_weights))(params)  # (G, K, d+1, d+1) each
            lam = _forget_factors(params, settings)
            if isinstance(Z, SharedTokens) and (FUSED_READOUT if fused is None else fused) and Z.y.dtype == jnp.float32:
                return gla.readout_mse_shared(Z.x, Z.y, y, WV[..., -1, :], WKQ, lam)
            if isinstance(Z, SharedTokens):
                zq = jnp.concatenate([jnp.broadcast_to(Z.x[:, -1, :], Z.y.shape[:2] + Z.x.shape[-1:]),
                                      Z.y[:, :, -1:]], axis=-1)  # (G, B, d+1) query tokens
                c = jnp.einsum("gbe,gkfe->gkbf", zq, WKQ)  # c = W^KQ z_q per prompt
                yhat = gla.readout_grid_shared(Z.x, Z.y, WV[..., -1, :], c, lam)
            else:
                c = jnp.einsum("gbe,gkfe->gkbf", Z[:, :, -1, :], WKQ)
                yhat = gla.readout_grid(Z, WV[..., -1, :], c, lam)
            return jnp.mean((yhat - y[:, None, :]) ** 2, axis=-1)
        return native
    if layers is not None and kernel == "native" and form in (None, "native"):
        def fused(params, batch, settings):  # each model's whole loss in one host call (multilayer_mse)
            Z, y = batch

            def row(p, Z_g, y_g, lam):
                return jax.vmap(lambda q, l: gla.multilayer_mse_native(q, Z_g, y_g, l))(p, lam)

            return jax.vmap(row)(params, Z, y, _forget_factors(params, settings))
        return fused
    form = form or ("native" if kernel == "native" else "parallel")
    forward = gla.predict if layers is None else functools.partial(gla.predict_multilayer, form=form)

    def loss(params, batch, settings):
        Z, y = batch  # (G, B, T, d+1), (G, B)

        def row(p, Z_g, y_g, lam):
            return jax.vmap(lambda q, l: jnp.mean((forward(q, Z_g, l) - y_g) ** 2))(p, lam)

        return jax.vmap(row)(params, Z, y, _forget_factors(params, settings))

    return loss


def train_groups(config: TrainConfig, gammas, groups: Mapping[str, Group], *, eval_set=None,
                 record_params: bool = False, reporter=None, label: str = "train", kernel: Kernel | None = None,
                 sampler: Kernel | None = None, normals: str = NORMALS):
    """Trains every model of every group jointly (``iclab.engines.train_members``), every seed at once.

    All models of a seed see the same batch at every step (common random numbers); their losses are
    summed, and since the optimiser acts elementwise every model follows the updates it would get alone.
    Member ids run over the groups in order (group by group, row-major over (G, K)) unless a group gives
    its own; model m of seed s is initialised from fold_in(fold_in(key_s, 1), m) and step k's batch drawn
    from fold_in(fold_in(key_s, 2), k), key_s = fold_in(PRNGKey(seed), s). The batch of a γ does not
    depend on the other γ (common random numbers), so a subset of a grid trained alone, with its ids,
    follows the same trajectory to float rounding.

    Args:
        config: training setting.
        gammas: (G,) AR(1) coefficients γ of the training prompts.
        groups: name -> model grid (see ``Group``).
        eval_set: None, or fixed prompts (Z (G, N, n+1, d+1), y (G, N)) on which every model's MSE is
            recorded (metric ``eval``: dict name -> (S, T, G, K)), in the training dtype.
        record_params: record the params at every record (``Trajectory.params``: name -> (S, T, G, K, ...)).
        reporter: progress reporter; the loop is one task named ``label``.
        kernel, sampler: how the models and the batches compute, ``xla`` or ``native`` (None: the run's backend,
            :func:`iclab.engines.backend`; apart, they let a test compare two kernels on the same batches).
        normals: the compiled sampler's normals (``tasks.drift.NORMALS``).
    Returns:
        (Trajectory, dict name -> final params with leading (S, G, K) axes, as float64). The Trajectory's
        ``loss`` is the sum of all models' batch losses.
    """
    dt = config.jnp_dtype()
    kernel, sampler = kernel or backend(), sampler or backend()
    gammas = jnp.asarray(gammas, dt)
    G = gammas.shape[0]
    Lam = jnp.asarray(config.Lam(), dt)
    members, first = {}, 0
    for name, grp in groups.items():
        lams = np.asarray(grp.lams, dtype=float)
        if lams.ndim != 2 or lams.shape[0] != G:
            raise ValueError(f"a group's lams must have shape (G = {G}, K) (got {lams.shape})")
        settings = {"lam": jnp.asarray(lams, dt)}
        if grp.learn is not None and np.any(grp.learn):
            settings["learn"] = jnp.asarray(np.broadcast_to(grp.learn, lams.shape))
        ids = first + np.arange(lams.size).reshape(lams.shape) if grp.ids is None else np.asarray(grp.ids)
        if ids.shape != lams.shape:
            raise ValueError(f"a group's ids must have the shape of its lams {lams.shape} (got {ids.shape})")
        members[name] = Members(init=functools.partial(_init_member, config, grp.layers, dt),
                                loss=_group_mse(grp.layers, kernel=kernel), ids=ids,
                                settings=settings)
        first = max(first, int(ids.max()) + 1)

    # one-layer models on native kernels read the tokens in the shared layout (inputs once, not once per γ)
    shared = sampler == "native" and kernel == "native" and all(grp.layers is None for grp in groups.values())

    def draw(key, aux):  # (not named `sampler`: that is the backend of the batches, read below)
        if shared:
            X, Y, y = sample_shared_batch(key, config.batch, gamma=gammas, **config.process(), Lam=Lam, dtype=dt,
                                          normals=normals)
            return SharedTokens(X, Y), y
        if sampler == "native":
            return sample_training_batch(key, config.batch, gamma=gammas, **config.process(), Lam=Lam, dtype=dt,
                                         normals=normals)
        pr = sample_drift_prompts(key, config.batch, gamma=gammas, **config.process(), Lam=Lam, dtype=dt)
        return tokens(pr), pr.target

    metrics, aux = {}, None
    if eval_set is not None:
        S = config.seeds
        aux = {"Z": jnp.broadcast_to(jnp.asarray(eval_set[0], dt), (S,) + eval_set[0].shape),
               "y": jnp.broadcast_to(jnp.asarray(eval_set[1], dt), (S,) + eval_set[1].shape)}
        metrics["eval"] = lambda p, a: {name: m.loss(p[name], (a["Z"], a["y"]), m.settings)
                                        for name, m in members.items()}
    tr = train_members(members, draw, keys=seed_keys(config.seed, config.seeds), lr=config.schedule(),
                       n_steps=config.steps, optimizer=config.transformation(), clip_norm=config.clip_norm or None,
                       record_every=config.record_every, aux=aux, metrics=metrics, record_member_loss=False,
                       record_params=record_params, reporter=reporter, label=label)
    final = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tr.final_params)
    return tr, final


def _init_member(config: TrainConfig, layers: int | None, dtype, key, setting):
    """One model's random Gaussian init; a θ = logit(λ) where λ is learnt (0, unused, elsewhere)."""
    p = gla.init_gla(key, config.d, config.parametrisation, config.init_std, layers=layers, dtype=dtype)
    if "learn" in setting:
        lam = setting["lam"]
        p["theta"] = jnp.where(setting["learn"], jnp.log(lam / (1 - lam)), 0.0).astype(dtype)
    return p


def train_grid(config: TrainConfig, gammas, lams, *, layers: int | None = None, learn=None, reporter=None,
               label: str = "train"):
    """``train_groups`` with one group: returns (Trajectory, final params with leading (S, G, K) axes)."""
    tr, params = train_groups(config, gammas, {"grid": Group(np.asarray(lams), layers, learn)}, reporter=reporter,
                              label=label)
    return tr, params["grid"]


# --------------------------------------------------------------------------------------------
# Memory estimates (``Experiment.memory``)


def prompt_bytes(*, G: int, B: int, T: int, d: int, item: int) -> float:
    """Bytes of a draw of B prompts of T tokens for G processes γ: the (G, B, T, d+1) tokens and the (G, B, T, d)
    AR(1) task vectors behind their labels (``sample_drift_prompts``), each twice (the scan's output and its moved
    axes; the tokens and their concatenation) — about 4·G·B·T·(d+1) numbers."""
    return 4.0 * item * G * B * T * (d + 1)


def training_memory(config: TrainConfig, *, G: int, models: int, deep_layers: int = 0,
                    eval_prompts: int = 0, eval_models: int = 0) -> list[Term]:
    """The terms of :func:`train_groups`: every seed's step at once (vmapped), float32 or float64.

    Per seed: the step's batch (:func:`prompt_bytes` of G processes × ``batch`` prompts of n + 1 tokens); each
    model's read-out residuals over the batch and their gradients (6 numbers per token); the full layers of the
    L-layer models (``deep_layers``: their count summed over the models) keep, per layer, the (T, T) decayed score
    matrix of the parallel form (XLA; the native kernels' recurrent form a (d+1)² state instead) and a few (T, d+1)
    activations per prompt for the backward pass. With a
    recorded evaluation set (drift.fig2's ``eval_prompts`` fixed prompts, ``eval_models`` models) the same
    forward runs on it at every record. The recorded loss itself is negligible.

    Args:
        config: the training setting (seeds, batch, n, d, dtype, steps, record_every).
        G: processes γ trained (rows of the grid); models: models trained (every row); deep_layers: Σ (L − 1)
            over the L-layer models; eval_prompts, eval_models: the recorded evaluation set.
    Returns:
        [(bytes, what)] terms for :func:`iclab.experiments._memory.total`.
    """
    S, B, T, d = config.seeds, config.batch, config.n + 1, config.d
    item = itemsize(config.dtype)
    terms = [(S * prompt_bytes(G=G, B=B, T=T, d=d, item=item),
              f"the {G}×{B}×{T}×{d + 1} token batch of {S} seed(s)"),
             (6.0 * item * S * models * B * T, f"the read-out residuals of {models} model(s) × {S} seed(s)")]
    if deep_layers and backend() == "native":  # the recurrent form's kernels: a (d+1)² state per prompt
        terms.append((2.0 * item * S * deep_layers * B * (4 * T * (d + 1) + (d + 1) ** 2),
                      f"the activations of {deep_layers} full layer(s) × {B} prompts × {S} seed(s)"))
    elif deep_layers:
        terms.append((2.0 * item * S * deep_layers * B * (T * T + 4 * T * (d + 1)),
                      f"the (n+1)² scores of {deep_layers} full layer(s) × {B} prompts × {S} seed(s)"))
    if eval_prompts:
        n = eval_prompts
        terms.append((item * S * (prompt_bytes(G=1, B=n, T=T, d=d, item=1) + 4.0 * eval_models * n * T
                                  + deep_layers * n * (T * T + 4 * T * (d + 1))),
                      "the recorded evaluation set's forward pass"))
    terms.append((records(seeds=S, steps=config.steps, record_every=config.record_every, values=2 + eval_models,
                          item=item), "the recorded losses"))
    return terms


def evaluation_memory(*, n: int, T: int, d: int, models: int, deep: bool = False) -> Term:
    """The largest :func:`model_errors` call: n float64 prompts of T tokens (:func:`prompt_bytes`, and the numpy
    copies of the eq-15 optimum's predictions: 10 numbers per token and coordinate in all; measured 6.6), the
    (M, n) predictions of M models, the optimum's and their squared errors, and for an L-layer model the (T, T)
    scores of one full layer per prompt."""
    need = prompt_bytes(G=1, B=n, T=T, d=d, item=FLOAT64) * 2.5 + 6.0 * FLOAT64 * models * n
    if deep:
        need += FLOAT64 * n * (T * T + 4 * T * (d + 1))
    return need, f"the {n}×{T}×{d + 1} float64 evaluation prompts and the predictions of {models} model(s)"


# --------------------------------------------------------------------------------------------
# Evaluation against the optimum


def eval_prompts(config: TaskConfig, key, N: int, gamma, m: int | None = None):
    """N float64 evaluation prompts of length m (default n) at γ (scalar or (G,)): (Z, y), Z (*G, N, m+1, d+1).

    A training config's (``TrainConfig``) are drawn as its training batches are: by the compiled sampler under the
    native backend, else by XLA."""
    gamma = jnp.asarray(gamma, jnp.float64)
    args = (key, jnp.asarray(config.Lam()), config.n if m is None else m, N, gamma, config.sigma_w2, config.sigma_e2)
    if isinstance(config, TrainConfig) and backend() == "native":
        return _draw_native(*args, normals=NORMALS)
    return _draw(*args)


@functools.partial(jax.jit, static_argnames=("n", "N"))
def _draw(key, Lam, n, N, gamma, sigma_w2, sigma_e2):
    pr = sample_drift_prompts(key, N, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n, Lam=Lam)
    return tokens(pr), pr.target


@functools.partial(jax.jit, static_argnames=("n", "N", "normals"))
def _draw_native(key, Lam, n, N, gamma, sigma_w2, sigma_e2, normals="ziggurat"):
    Z, y = sample_training_batch(key, N, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n, Lam=Lam,
                                 dtype=jnp.float64, normals=normals)
    return (Z[0], y[0]) if gamma.ndim == 0 else (Z, y)


@functools.partial(jax.jit, static_argnames=("layers",))
def _model_predictions(params, Z, lams, layers=None):
    """Predictions of models (M, ...) at forget factors lams (M,) on shared prompts Z (N, T, d+1): (M, N)."""
    forward = gla.predict if layers is None else gla.predict_multilayer
    return jax.lax.map(lambda pl: forward(pl[0], Z, pl[1]), (params, lams))


def model_predictions(params, Z, lams, layers: int | None = None) -> np.ndarray:
    """Float64 predictions of M stacked models (leading axis M of params) on prompts Z at lams (M,)."""
    return np.asarray(_model_predictions(params, jnp.asarray(Z), jnp.asarray(lams, jnp.float64), layers=layers))


def optimal_predictions(config: TaskConfig, Z, lam_train: float, gamma_train: float, lam_bars) -> np.ndarray:
    """Eq 15/18 predictions of the Theorem 1 optimum trained at (λ, γ), at test-time forget factors λ̄.

    Args:
        Z: (N, T, d+1) prompts; lam_bars: (K,) test-time forget factors.
    Returns:
        (K, N) array.
    """
    D1, D2, D3, _ = theory.D_sums(lam_train, gamma=gamma_train, **config.process())
    Lt = theory.Lam_tilde(config.Lam(), D2=D2, D3=D3)
    Z = np.asarray(Z)
    return np.stack([theory.optimal_prediction(Z, float(lb), D1=D1, Lam_t=Lt) for lb in np.atleast_1d(lam_bars)])


def model_errors(config: TaskConfig, params, lam_train, gamma_train: float, lam_eval, E_theory, key, *,
                 gamma_eval: float | None = None, m: int | None = None, layers: int | None = None) -> dict:
    """Population errors of M trained models of one seed on prompts of length m at test-time λ̄.

    One-layer restricted weights: exact, ``theory.drift.restricted_error`` (standard error 0).
    Otherwise: ``config.n_eval`` fresh float64 prompts drawn from ``key``, shared by the M models, and
    the control-variate estimate Thm 2/3 + mean[(ŷ−y)² − (ŷ_opt−y)²] (``control_variate_risk``) beside
    the eq-15/18 optimum trained at the same (λ, γ). Test prompts keep the training σ_w², σ_e².

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
        prompts = dict(gamma=gbar, sigma_w2=config.sigma_w2, sigma_e2=config.sigma_e2, n=mm, Lam=config.Lam())
        err = np.array([theory.restricted_error(np.asarray(params["U11"][i]), float(params["u_m1"][i]),
                                                lam=float(lam_eval[i]), **prompts)
                        for i in range(lam_eval.size)])
        return {"err": err, "err_se": np.zeros_like(err)}
    Z, y = eval_prompts(config, key, config.n_eval, gbar, m=mm)
    y = np.asarray(y)
    y_opt = np.stack([optimal_predictions(config, Z, float(lt), gamma_train, [float(le)])[0]
                      for lt, le in zip(lam_train, lam_eval)])
    y_model = model_predictions(params, Z, lam_eval, layers=layers)
    e = control_variate_risk((y_model - y) ** 2, (y_opt - y) ** 2, E_theory)
    return {"err": e["risk"], "err_se": e["risk_se"], "opt": e["ref"], "opt_se": e["ref_se"]}


# --------------------------------------------------------------------------------------------
# Baselines on held-out prompts: eq 15's algorithm and the Kalman filter


@functools.partial(jax.jit, static_argnames=("layers",))
def _eq15_match(params, lams, P, Z, y, layers=None):
    """Models (M, ...) at forget factors lams (M,) against WPGD with P (M, d, d) and ω_i = λ^{n+1−i}, one prompt set."""
    forward = gla.predict if layers is None else gla.predict_multilayer
    n = Z.shape[-2] - 1

    def match(args):
        p, lam, P_m = args
        omega = baselines.exponential_weights(n, lam=lam, dtype=Z.dtype)

        def model(Z_):
            return forward(p, Z_, lam)

        def alg(Z_):
            return baselines.wpgd(*baselines.split_drift_tokens(Z_), P=P_m, omega=omega)

        m = baselines.algorithm_match(model, alg, Z, query=baselines.DRIFT_TOKENS_QUERY)
        risk = baselines.mc_risk(alg, Z, target=y)
        return jnp.stack([m.gap, m.gap_se, m.cosine, m.cosine_se, risk.mean, risk.se])

    return jax.lax.map(match, (params, lams, P))


def eq15_algorithm_match(config: TaskConfig, params, lams, gamma: float, Z, y, layers: int | None = None) -> dict:
    """Issue 22: trained models against eq 15's predictor at their own λ, on shared held-out prompts Z.

    The algorithm is the exponentially weighted estimator of Theorem 1, WPGD with ω_i = λ^{n+1−i}
    (``iclab.baselines.exponential_weights``) and P = D1 Λ̃⁻¹ (the training (λ, γ)'s D1 and Λ̃), on the
    context and query of the tokens (``iclab.baselines.split_drift_tokens``); the model is the trained GLA on
    the same tokens (any parametrisation).

    Args:
        config: the task setting; params: M stacked models (leading axis M); lams: (M,) their forget factors.
        gamma: the training γ; Z: (N, n+1, d+1) held-out tokens and y: (N,) their targets (``eval_prompts``).
        layers: None for one layer, L for the L-layer residual GLA.
    Returns:
        dict of (M,) arrays: gap E(ŷ − ŷ_eq15)² (no ½), gap_se, cosine (mean query-sensitivity cosine), cosine_se,
        alg_risk, alg_risk_se (eq 15's Monte Carlo error on the prompts, no ½).
    """
    lams = np.atleast_1d(np.asarray(lams, dtype=float))
    P = []
    for lam in lams:
        D1, D2, D3, _ = theory.D_sums(float(lam), gamma=gamma, **config.process())
        P.append(D1 * np.linalg.inv(theory.Lam_tilde(config.Lam(), D2=D2, D3=D3)))
    res = np.asarray(_eq15_match(params, jnp.asarray(lams), jnp.asarray(np.stack(P)), jnp.asarray(Z), jnp.asarray(y),
                                 layers=layers))
    return {"gap": res[:, 0], "gap_se": res[:, 1], "cosine": res[:, 2], "cosine_se": res[:, 3], "alg_risk": res[:, 4],
            "alg_risk_se": res[:, 5]}


@jax.jit
def _kalman(Z, y, gamma, sigma_w2, sigma_e2, Lam):
    x, y_ctx, x_q = baselines.split_drift_tokens(Z)
    # one pass of the filter gives both: the posterior mean of w_{n+1} (kalman_posterior_mean) and its covariance,
    # which does not depend on the labels (kalman_bayes_risk = tr(Λ Cov))
    kf = baselines.kalman_filter(x, y_ctx, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2)
    pred = jnp.sum(kf.mean * x_q, axis=-1)
    risk = jnp.sum(Lam * kf.cov, axis=(-2, -1))
    mc = baselines.mean_and_se((pred - y) ** 2)
    rb = baselines.mean_and_se(risk)
    diff = baselines.mean_and_se((pred - y) ** 2 - risk)
    return jnp.stack([rb.mean, rb.se, mc.mean, mc.se, diff.mean, diff.se])


def kalman_risk(config: TaskConfig, gamma: float, Z, y) -> dict:
    """Bayes risk of drift's AR(1) data model on held-out prompts (Z, y), no ½: the Kalman filter.

    ``bayes``/``bayes_se``: the exact risk given each prompt's context inputs (``iclab.baselines.kalman_bayes_risk``,
    the query integrated out) averaged over the prompts; ``bayes_mc``/``bayes_mc_se``: the Kalman posterior mean's
    squared error on the same prompts (its Monte Carlo twin); ``mc_minus_bayes``/``mc_minus_bayes_se``: their
    difference paired per prompt (mean 0 when the filter's model is the sampler's).

    Args:
        config: the task setting (σ_w², σ_e², Λ); gamma: the prompts' γ; Z: (N, n+1, d+1) tokens; y: (N,) targets.
    Returns:
        dict of floats.
    """
    v = np.asarray(_kalman(jnp.asarray(Z), jnp.asarray(y), gamma, config.sigma_w2, config.sigma_e2,
                           jnp.asarray(config.Lam())))
    return {"bayes": v[0], "bayes_se": v[1], "bayes_mc": v[2], "bayes_mc_se": v[3], "mc_minus_bayes": v[4],
            "mc_minus_bayes_se": v[5]}


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
