"""The moments engine's plain GD by compiled CPU kernels, for the reduced linattn models.

The same contract as :func:`iclab.engines.moments.full_batch` with plain GD (``optimizer=None``), the loop in
the compiled kernels of :mod:`iclab.ops` (:func:`iclab.ops.moments_plain_gd`: a step of the Fig 4 setting is
nearly all XLA's fixed cost per operation, which the kernel does not pay). It follows the XLA engine's
trajectory to rounding (tests compare both, and both against full-batch GD on the prompts).
"""

from __future__ import annotations

import numpy as np

from iclab.engines._loop import Callback, DivergenceGuard, Trajectory, record_steps
from iclab.engines.moments import SufficientStatistics
from iclab.ops import MOMENTS_MODELS as NATIVE_MODELS, MomentsModel as NativeModel, moments_plain_gd

__all__ = ["NATIVE_MODELS", "NativeModel", "full_batch"]


def full_batch(
    model: NativeModel,
    params0: dict,
    stats: SufficientStatistics,
    *,
    lr: float,
    n_steps: int,
    record_every: int = 1,
    record_params: bool = False,
    batched: bool = False,
    callback: Callback | None = None,
    records_per_chunk: int = 64,
) -> Trajectory:
    """Plain GD with constant ``lr`` on ``quadratic_loss(T(θ), stats)`` for a reduced linattn model.

    The contract of :func:`iclab.engines.moments.full_batch` with plain GD (``optimizer=None``): records
    at steps 0, r, 2r, ... and the last; ``loss`` is the full-batch loss of the params at each
    record; t = step·lr. The loop runs on the host, ``records_per_chunk`` records per kernel call;
    after each call ``callback(step, {"loss": ...})`` reports progress and, when the callback asks
    for it (``stop_on_divergence``), a non-finite loss stops the run with
    :class:`iclab.engines._loop.Diverged`, as in the XLA loop. There are no checkpoints: a run of
    this engine is short. Seeds (``batched``: a leading axis on params and stats) run on up to
    ``ICLAB_THREADS`` threads (the kernel releases the GIL); each seed's numbers do not depend on it.

    Args:
        model: "attn_s" (params v (H,), k, q (H, R, D)), "attn_m" (v (H,), U (H, D, D)) or "mlp"
            (w2 (H,), W1 (H, D²)).
        params0: initial params (float64).
        stats: c, m (D²,), G (D², D²) of the training prompts (the cubic feature z).
    Returns:
        Trajectory with ``loss`` (T,) or (S, T), ``params`` (recorded, if asked) and no metrics.
    """
    if model not in NATIVE_MODELS:
        raise ValueError(f"model must be one of {NATIVE_MODELS} (got {model!r})")
    if not lr > 0:
        raise ValueError(f"lr must be > 0 (got {lr})")
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0 (got {n_steps})")
    if record_every < 1:
        raise ValueError(f"record_every must be >= 1 (got {record_every})")
    if records_per_chunk < 1:
        raise ValueError(f"records_per_chunk must be >= 1 (got {records_per_chunk})")
    steps = record_steps(n_steps, record_every)
    params0 = {k: np.asarray(a, dtype=np.float64) for k, a in params0.items()}
    c, m, G = (np.asarray(a, dtype=np.float64) for a in (stats.c, stats.m, stats.G))
    if not batched:
        params0 = {k: a[None] for k, a in params0.items()}
        c, m, G = c[None], m[None], G[None]
    S = m.shape[0]
    guard = DivergenceGuard(callback, batched, record_axis=0)
    t = steps * float(lr)

    def on_chunk(last: int, losses: np.ndarray) -> None:  # losses (records so far, S)
        if callback is not None:
            callback(int(steps[last - 1]), {"loss": losses[-1] if batched else losses[-1, 0]})
        guard.check([{"loss": losses if batched else losses[:, 0],
                      "t": np.repeat(t[:last, None], S, axis=1) if batched else t[:last]}], steps)

    loss, params = moments_plain_gd(model, params0, G, m, c, lr=float(lr), steps=steps, record_params=record_params,
                                    records_per_chunk=records_per_chunk, on_chunk=on_chunk)
    if params is not None and not batched:
        params = {k: a[0] for k, a in params.items()}
    return Trajectory(step=steps.astype(float), t=t, loss=loss if batched else loss[0], metrics={}, params=params)
