"""The population engine: descent on an exact expected loss, no sampling noise.

``loss_fn(params, aux)`` is a closed-form expected loss (e.g. L(A) of the linattn paper, :mod:`iclab.theory.linattn`);
``aux`` holds the constants it needs (covariance, E(1/N), ...), batched along seeds with the params
when ``batched``. Two integrators share the time axis t = Σ lr:

- :func:`gradient_descent`: any optax optimiser (plain GD by default), t = Σ_k lr_k.
- :func:`gradient_flow`: dθ/dt = −∇L(θ), integrated with diffrax (the small-lr limit of GD).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from iclab.engines._descent import descend
from iclab.engines._loop import Callback, DivergenceGuard, Trajectory, _concat, loop_checkpoint

__all__ = ["gradient_descent", "gradient_flow"]


def gradient_descent(loss_fn: Callable[[Any, Any], jax.Array], params0, aux=None, **options) -> Trajectory:
    """Descends the exact expected loss: θ_{k+1} = θ_k − lr_k u_k, u_k the optimizer's direction of ∇L(θ_k).

    Args:
        loss_fn: the closed-form expected loss, (params, aux) -> scalar.
        params0: initial params (leading seed axis S when ``batched``).
        aux: constants of the loss (covariance, E(1/N), ...), batched with the params.
        options: those of :func:`iclab.engines._descent.descend`: lr (float or schedule), n_steps,
            optimizer (an optax GradientTransformation without lr; None: plain GD), record_every,
            metrics ({name: fn(params, aux)}), record_params, batched, callback, unroll.
    Returns:
        A Trajectory on t = Σ lr whose ``loss`` is the expected loss at each record.
    """
    return descend(lambda params, state: loss_fn(params, state.aux), params0, aux, **options)


def gradient_flow(
    loss_fn: Callable[[Any, Any], jax.Array],
    params0,
    aux=None,
    *,
    t_max: float,
    n_records: int = 200,
    ts: np.ndarray | None = None,
    rtol: float = 1e-10,
    atol: float = 1e-12,
    metrics: dict[str, Callable[[Any, Any], jax.Array]] | None = None,
    record_params: bool = False,
    batched: bool = False,
    callback: Callback | None = None,
    max_steps: int = 1_000_000,
) -> Trajectory:
    """Integrates dθ/dt = −∇_θ L(θ) from t = 0 to t_max with diffrax (Dopri8, PID step control).

    Args:
        loss_fn: expected loss, (params, aux) -> scalar.
        params0: initial params (leading seed axis if ``batched``).
        aux: constants passed to loss_fn and metrics.
        t_max: final time.
        n_records: evenly spaced record times in [0, t_max] (ignored if ``ts`` is given).
        ts: explicit record times, increasing, starting at 0.
        rtol, atol: step-size controller tolerances.
        metrics: {name: fn(params, aux)} recorded beside the loss.
        record_params: also record the params at every record time.
        batched: vmap over a leading seed axis of params0 and aux.
        callback: progress callback (checkpoints and divergence guard, see :mod:`iclab.engines._loop`).
        max_steps: the solver's step budget per record interval.
    Returns:
        A Trajectory with step = NaN (gradient flow has no steps) and ``final_params`` the params at t_max.
    """
    if not t_max > 0:
        raise ValueError(f"t_max must be > 0 (got {t_max})")
    ts = np.linspace(0.0, t_max, n_records) if ts is None else np.asarray(ts, dtype=float)
    metrics = metrics or {}
    import diffrax  # here, not at module level: importing diffrax costs ~1 s that a reused run never needs

    term = diffrax.ODETerm(lambda t, y, args: jax.tree_util.tree_map(jnp.negative, jax.grad(loss_fn)(y, args)))
    solver = diffrax.Dopri8()
    controller = diffrax.PIDController(rtol=rtol, atol=atol)

    def observe(params, aux):
        out = {"loss": loss_fn(params, aux)}
        out.update({name: fn(params, aux) for name, fn in metrics.items()})
        if record_params:
            out["params"] = params
        return out

    def step_to(params, aux, t0, t1):
        # One solve per record interval, ending exactly on the record time: dense-output
        # interpolation between large adaptive steps would cost accuracy (~1e-8 for Dopri8).
        sol = diffrax.diffeqsolve(term, solver, t0, t1, None, params, args=aux,
                                  saveat=diffrax.SaveAt(t1=True), stepsize_controller=controller,
                                  max_steps=max_steps)
        return jax.tree_util.tree_map(lambda a: a[-1], sol.ys)

    def segment(params, aux, times):
        def body(p, pair):
            p = step_to(p, aux, pair[0], pair[1])
            return p, observe(p, aux)

        return jax.lax.scan(body, params, jnp.stack([times[:-1], times[1:]], axis=1))

    seg = jax.jit(jax.vmap(segment, in_axes=(0, 0, None)) if batched else segment)
    first = jax.jit(jax.vmap(observe) if batched else observe)(params0, aux)
    axis = 1 if batched else 0
    records = [jax.tree_util.tree_map(lambda a: np.expand_dims(np.asarray(a), axis), first)]
    params = params0
    # Segments of equal numbers of record times keep one compiled solve and let the host
    # report progress (and save checkpoints, and watch for divergence) between them.
    chunk = 16
    idx = 1
    ckpt = loop_checkpoint(callback)
    guard = DivergenceGuard(callback, batched, record_axis=axis)
    expect = {"kind": "gradient_flow", "ts": _digest(ts), "batched": bool(batched), "chunk": chunk,
              "rtol": rtol, "atol": atol, "max_steps": int(max_steps)}
    if ckpt is not None:
        restored = ckpt.load(expect, params0, records[0])
        if restored is not None:
            meta, params, saved = restored
            records, idx = [saved], int(meta["idx"])
            ckpt.note(f"resumed at t = {ts[idx - 1]:.6g} of {ts[-1]:.6g}")
            if callback is not None:
                callback(idx - 1, jax.tree_util.tree_map(lambda a: np.asarray(a)[..., -1], saved))
    guard.check(records, None, ts)
    while idx < len(ts):
        times = ts[idx - 1 : idx + chunk]
        params, obs = seg(params, aux, jnp.asarray(times))
        records.append(jax.tree_util.tree_map(np.asarray, obs))
        idx += len(times) - 1
        if callback is not None:
            callback(idx - 1, jax.tree_util.tree_map(lambda a: np.asarray(a)[..., -1], obs))
        guard.check(records, None, ts)
        if ckpt is not None and (ckpt.due() or idx >= len(ts)):
            records = [_concat(records, axis)]
            ckpt.save(dict(expect, idx=idx), params, records[0])
    obs = _concat(records, axis)
    loss = obs.pop("loss")
    params_rec = obs.pop("params", None)
    return Trajectory(step=np.full(len(ts), np.nan), t=ts, loss=loss, metrics=obs, params=params_rec,
                      final_params=params)


def _digest(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float64).tobytes()).hexdigest()[:16]
