# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Task diversity: two Bayes predictors, one linear optimum, a transformer in between
#
# Raventós et al. (2023, *Pretraining task diversity and the emergence of non-Bayesian in-context learning for
# regression*) pretrain a transformer on noisy in-context linear regression, x_n, x_q ~ N(0, I_D),
# y = wᵀx + σε on context and query alike, with each prompt's task w drawn uniformly from a **pool** of M vectors
# w_1..w_M ~ N(0, I) fixed before training ([`iclab.tasks.pool`](../api/iclab.tasks.pool.md)). Two Bayes
# predictors frame what it can learn ([`iclab.baselines`](../api/iclab.baselines.md)):
#
# - **dMMSE**, the posterior mean over the pool: the prior is uniform over the M tasks and the likelihood of task
#   m is Gaussian, so the posterior is a softmax of the log-likelihoods,
#
#   p(m | X, y) = softmax_m(−‖y − X w_m‖² / (2σ²)),  ŷ = Σ_m p(m | X, y) w_mᵀ x_q
#
#   (`pool_posterior_mean`): Bayes on the pool's own tasks;
# - **ridge**, the posterior mean under the Gaussian prior w ~ N(0, I),
#
#   ŷ = x_qᵀ E[w | X, y] = x_qᵀ (XᵀX + σ² I)⁻¹ Xᵀ y
#
#   (`gaussian_posterior_mean`, penalty σ²): Bayes on fresh tasks from the prior.
#
# Their finding: below a threshold of M the transformer behaves like dMMSE (it fits the pool and fails on fresh
# tasks), above it like ridge on fresh tasks, although dMMSE stays the Bayes predictor of its pretraining
# distribution. The experiment `lab.task_diversity` runs that setting with a small GPT-2-style transformer, linear
# attention and one-layer softmax attention beside dMMSE, ridge and linear attention's closed form
# ([`iclab.theory.task_diversity`](../api/iclab.theory.task_diversity.md)). This page checks the two Bayes
# predictors and the closed form against Monte Carlo first, then runs the experiment at its quick preset.

# %%
import io
import time
from pathlib import Path

import jax
import numpy as np

import iclab  # noqa: F401  (turns on float64)
from iclab import baselines as bl
from iclab.experiments import get_experiment
from iclab.progress import Reporter
from iclab.theory import task_diversity as theory

exp = get_experiment("lab.task_diversity")
config = exp.resolve("quick", {})
task = config.task   # the prompts' settings, held whole: an iclab.tasks.pool.PoolTask (task.D, task.N, task.sigma2)
D, N, sigma2 = task.D, task.N, task.sigma2
print(f"the quick preset's prompts: D = {D}, N = {N}, σ² = {sigma2:g}; pool sizes M = {config.pool_sizes} (0: ∞)")

# %% [markdown]
# ## Each Bayes predictor wins on its own distribution
#
# One pool of M = 8 tasks; 20 000 prompts from the pool and 20 000 with fresh tasks; dMMSE and ridge predict the
# query of the **same** prompts, so their difference is a paired Monte Carlo estimate whose standard error (SE)
# is that of the per-prompt difference. Each must beat the other on its own distribution: on the pool dMMSE knows
# that w is one of 8 vectors, on fresh tasks that knowledge is wrong. Ridge's error on fresh tasks is also checked
# against its exact value, the mean over the contexts of the conditional Bayes risk tr Cov[w | X] + σ²
# (`gaussian_bayes_risk`, paired on the same contexts).

# %%
P, M_BAYES = 20_000, 8
pool = task.pool(jax.random.PRNGKey(0), 1024)          # nested pools: size M is the first M rows
eye = np.eye(D)
prompts = {"pool": task.prompts(jax.random.PRNGKey(1), P, pool=pool[:M_BAYES]),
           "fresh": task.prompts(jax.random.PRNGKey(2), P)}
sq = {}
for dist, p in prompts.items():
    predictions = {"dMMSE": bl.pool_posterior_mean(p.x, p.y, p.x_q, pool=pool[:M_BAYES], sigma2=sigma2),
                   "ridge": bl.gaussian_posterior_mean(p.x, p.y, p.x_q, prior_cov=1.0, sigma2=sigma2)}
    sq[dist] = {name: np.asarray(y_hat - p.y_q) ** 2 for name, y_hat in predictions.items()}
print(f"M = {M_BAYES}, {P} prompts each   dMMSE            ridge            dMMSE − ridge (paired)   z")
z_gap = {}
for dist in ("pool", "fresh"):
    a, b = (bl.mean_and_se(sq[dist][n]) for n in ("dMMSE", "ridge"))
    d = bl.mean_and_se(sq[dist]["dMMSE"] - sq[dist]["ridge"])
    z_gap[dist] = float(d.mean / d.se)
    print(f"{dist + ' tasks':<28} {a.mean:.4f} ± {a.se:.4f}  {b.mean:.4f} ± {b.se:.4f}  {d.mean:+.4f} ± {d.se:.4f}"
          f"          {z_gap[dist]:+.1f}")
exact = np.asarray(bl.gaussian_bayes_risk(prompts["fresh"].x, Lam=eye, prior_cov=1.0, sigma2=sigma2)) + sigma2
ridge_gap = bl.mean_and_se(sq["fresh"]["ridge"] - exact)
z_ridge = float(ridge_gap.mean / ridge_gap.se)
print(f"ridge on fresh tasks against its exact Bayes risk {exact.mean():.4f}: z = {z_ridge:+.2f}")
assert z_gap["pool"] < -4 and z_gap["fresh"] > 4, z_gap       # each wins on its own distribution, by > 4 SE
assert abs(z_ridge) <= 4, z_ridge                              # ridge = its exact risk within 4 SE

# %% [markdown]
# ## The best linear in-context predictor on a pool, in closed form
#
# Linear attention reduces to ŷ = x_qᵀ Γ β with β = (1/N) Σ_n y_n x_n (ATTN_M's reduced form with Γ = Aᵀ). Given
# the task, E[β | w] = w, and the Wishart moment E[S A S] = ((N+1)/N) A + tr(A) I / N of S = (1/N) Σ_n x_n x_nᵀ
# gives E[ββᵀ] = B(Σ) = ((N+1)/N) Σ + ((tr Σ + σ²)/N) I, where Σ = E[wwᵀ] is all the predictor sees of the task
# distribution: Σ_M = (1/M) Σ_m w_m w_mᵀ for the pool, I for fresh tasks. With x_q integrated out,
#
# R(Γ; Σ) = tr(Γ B(Σ) Γᵀ) − 2 tr(Γ Σ) + tr Σ + σ²,
#
# a convex quadratic in Γ, minimised at Γ*(Σ) = Σ B(Σ)⁻¹. Pretrained on the pool, the optimum is
# Γ_M = Γ*(Σ_M) (`theory.optimal_linear`); its risk on the pool is R(Γ_M; Σ_M), on fresh tasks R(Γ_M; I), and as
# M grows Σ_M → I and both tend to R*(I), the best a linear in-context predictor does on fresh tasks. Since Γβ
# cannot invert the context's Gram matrix, R*(I) stays above ridge's Bayes risk.
#
# Below: Γ_M on the nested pools M = 1 … 1024 and ∞, the closed-form risks against a Monte Carlo of
# ŷ = x_qᵀ Γ_M β computed directly from the prompts (20 000 each, float64), 4 SE each.

# %%
sizes = [1, 2, 4, 8, 32, 128, 1024, 0]
print("   M   R(Γ_M; Σ_M)  Monte Carlo        z      R(Γ_M; I)  Monte Carlo        z")
zs, fresh_risks = [], []
for i, M in enumerate(sizes):
    Sigma = eye if M == 0 else theory.pool_second_moment(pool[:M])
    Gamma = theory.optimal_linear(Sigma, N=N, sigma2=sigma2)
    row = f"{'∞' if M == 0 else M:>4}"
    for j, (S_eval, p) in enumerate(((Sigma, None if M == 0 else pool[:M]), (eye, None))):
        pr = task.prompts(jax.random.PRNGKey(10 + 2 * i + j), P, pool=p)
        x, y, x_q, y_q = (np.asarray(a) for a in (pr.x, pr.y, pr.x_q, pr.y_q))
        beta = np.einsum("pn,pnd->pd", y, x) / N
        mc = bl.mean_and_se((np.einsum("pd,de,pe->p", x_q, Gamma, beta) - y_q) ** 2)
        closed = float(theory.linear_risk(Gamma, S_eval, N=N, sigma2=sigma2))
        zs.append(float((mc.mean - closed) / mc.se))
        row += f"   {closed:.4f}     {mc.mean:.4f} ± {mc.se:.4f}  {zs[-1]:+.2f}"
    fresh_risks.append(float(theory.linear_risk(Gamma, eye, N=N, sigma2=sigma2)))
    print(row)
r_star = theory.pool_linear_risks(pool[:1], N=N, sigma2=sigma2).fresh_optimum
ridge_exact = bl.mean_and_se(exact)
print(f"R*(I), the best linear predictor on fresh tasks: {float(r_star):.4f}; ridge's exact Bayes risk: "
      f"{ridge_exact.mean:.4f} ± {ridge_exact.se:.4f}")
assert max(abs(z) for z in zs) <= 4, zs                        # closed form = Monte Carlo within 4 SE
assert min(fresh_risks) >= float(r_star) - 1e-12               # R*(I) is the minimum over Γ on fresh tasks
assert fresh_risks[sizes.index(8)] <= 1.05 * float(r_star)     # at D = 2, Γ_8 is already near the fresh optimum
assert float(r_star) > ridge_exact.mean + 4 * ridge_exact.se   # and stays above ridge's (Bayes) risk

# %% [markdown]
# ## The experiment: three models pretrained on M = 1, 8, ∞
#
# The quick preset, one seed: D = 2, N = 8, σ² = 0.25, pools M ∈ {1, 8, ∞}; a transformer of two blocks of width
# 32 with learned positions, trained on every label predicted from the tokens before it; linear attention ATTN_M;
# the mhsa paper's one-layer softmax attention (eq 2.1); all nine (model, M) members in one joint training loop
# (`iclab.engines.train_members`), 1500 Adam steps of 64 prompts each. Then every model, dMMSE and ridge predict
# the same 2048 pool prompts and 2048 fresh prompts per M.

# %%
start = time.perf_counter()
r = exp.run(config, Reporter())
print(f"trained 3 models × {len(config.pool_sizes)} pool sizes and evaluated in {time.perf_counter() - start:.0f} s\n")
names = [("transformer", "transformer"), ("linear", "linear attn"), ("softmax", "softmax attn"),
         ("theory", "Γ_M (theory)"), ("dmmse", "dMMSE"), ("ridge", "ridge")]
for dist in ("pool", "fresh"):
    print(f"error on {dist} tasks (seed 0; ± 1 SE)")
    print("   M  " + "".join(f"{label:>19}" for _, label in names))
    for k, M in enumerate(config.pool_sizes):
        cells = []
        for key, _ in names:
            v = r[f"{key}_{dist}"][0, k]
            se = r.get(f"{key}_{dist}_se")
            cells.append(f"{'-':>19}" if np.isnan(v) else f"{v:>11.4f}" + (f" ± {se[0, k]:.3f}" if se is not None
                                                                                else " " * 8))
        print(f"{'∞' if M == 0 else M:>4}  " + "".join(cells))
    print()

# %%
fig = exp.plot(config, r)   # the experiment's figure, drawn on the Agg backend (made for files): shown as a PNG
png = io.BytesIO()
fig.savefig(png, format="png", dpi=110)
try:
    from IPython.display import Image, display
    display(Image(png.getvalue()))
except ImportError:  # run as a plain script without IPython
    Path("task_diversity.png").write_bytes(png.getvalue())
    print("figure written to task_diversity.png")

# %% [markdown]
# ## What the short training reaches, and the checks
#
# At M = 1 the transformer has learnt the one task and ignores the context: its fresh-task error sits at dMMSE's
# (with one task in the pool dMMSE predicts w_1ᵀx_q whatever the context), far above ridge's. Linear attention
# cannot store a task in its weights (ŷ = x_qᵀΓβ reads w only through β); at M = 1 its optimum Γ_1 keeps the
# direction of w_1, so its fresh-task error is lower than the transformer's there, as the closed form says. At
# M = ∞ the transformer has become an in-context learner on fresh tasks: its error is a fraction of D + σ², the
# error of ignoring the context, near the best linear in-context predictor R*(I) and still above ridge. Those are
# the transition's two ends; 1500 steps of a two-block transformer do **not** reach ridge on fresh tasks (the
# ratio is printed by the checks below). At D = 2 eight tasks already nearly span the task space (Σ_8 is close
# to I, and the linear optimum's fresh-task risk at M = 8 is within a few per cent of R*(I) in the table above),
# so M = 8 lies much nearer the M = ∞ end than the M = 1 end. Linear attention reaches its closed-form optimum Γ_M
# at every M, on the pool and on fresh tasks. The `paper` preset (D = 8, N = 16, M from 1 to 16 384 and ∞, four
# blocks of width 128, 50 000 steps) is for locating the transition itself along M, as in Raventós et al.'s
# figures, and for training long enough to approach ridge; it takes far longer than a page built in a minute.
#
# The experiment's own ten checks, with their tolerances and reasons: at the smallest M the transformer's
# fresh-task error equals dMMSE's (15 %) and is closer to dMMSE's than to ridge's; the transition (at M = ∞ its
# excess over ridge at most a quarter of its excess at M = 1); in-context learning at M = ∞ (at most 0.6 of
# D + σ²); linear attention's Monte Carlo error against the exact risk of its trained matrix (4 SE) and against the
# pool optimum Γ_M (5 % for Adam stopping near it); and no model below the Bayes predictor of the distribution it
# is evaluated on (paired, 3 SE).

# %%
checks = exp.checks(config, r)
for c in checks:
    print("PASS" if c.passed else "FAIL", c.name, f"(measured {c.measured:.3g})")
assert all(c.passed for c in checks), [c.name for c in checks if not c.passed]
t_1, t_8, t_inf = r["transformer_fresh"][0]                          # M = 1, 8, ∞
assert r["ridge_fresh"][0, -1] < t_inf < D + sigma2                 # between ridge and ignoring the context
assert t_8 - t_inf < t_1 - t_8                                      # M = 8 nearer the M = ∞ end
assert r["linear_fresh"][0, 0] < t_1                                # at M = 1 linear attention still reads β
print(f"transformer's fresh-task error / ridge's at M = ∞: {t_inf / r['ridge_fresh'][0, -1]:.2f}; "
      f"/ R(Γ_∞) (the best linear predictor): {t_inf / r['theory_fresh'][0, -1]:.2f}")
