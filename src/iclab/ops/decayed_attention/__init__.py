"""Decayed-state attention: S_t = d_t S_{t−1} + v_t k_tᵀ, o_t = S_t q_t (q, k, v linear in the token z_t).

The gating paper's GLA layer has d_t = φ(w_gᵀz_t), a scalar gate of the token (or φ(W_g z_t), a vector
gate); the drift paper's has d_t = λ, a constant forget factor. Both papers' models stack such layers
with a residual stream and read the prediction at the query's label coordinate.

- :mod:`.gated` (d_t a gate) and :mod:`.forget` (d_t = λ): the compiled CPU forms, layer kernels in LLVM IR
  (``_layer_ir``, ``_readout_ir``) and numba, host calls from jitted code, custom VJPs whose forward pass also
  computes the gradient; a grid of models in one host call (``_grid_driver``: one compiled loop per thread).
- :mod:`.naive`: the pure-JAX recurrences, the reference every fast form is tested against, and what the
  ``xla`` backend runs.

:func:`forget_layer`, :func:`gated_layer`, :func:`forget_readout_grid` and :func:`forget_multilayer_mse` take
a ``backend`` (``native``, ``xla``, ``auto``; None: the backend in force, :func:`iclab.ops.backend`). The grids
of the gating paper's models and the shared-layout read-outs are the compiled forms only: their references are
the models' own vmapped predictions (``iclab.models``), against which ``tests/ops`` checks them.

Weights are arrays: the forget layer takes (W_Q, W_K, W_V) and λ; the gated grids take each layer's named
arrays ``{"Wq", "Wk", "Wv"}`` plus its gate ``"w_g"`` (D,) or ``"W_g"`` (D, D) and an optional head
``"h"``, stacked over the grid's (M, G) axes.
"""

from iclab.ops._runtime.backend import backend as _backend_in_force
from iclab.ops._runtime.backend import resolve_backend
from iclab.ops.decayed_attention import forget, gated, naive
from iclab.ops.decayed_attention.forget import readout_grid_shared as forget_readout_grid_shared
from iclab.ops.decayed_attention.forget import readout_mse_shared as forget_readout_mse_shared
from iclab.ops.decayed_attention.gated import subsequence_positions
from iclab.ops.decayed_attention.gated import multilayer_mse_grid as gated_multilayer_mse_grid  # noqa: E402
from iclab.ops.decayed_attention.gated import multilayer_mse_grids as gated_multilayer_mse_grids
from iclab.ops.decayed_attention.gated import query_mse_grid as gated_query_mse_grid

__all__ = ["forget_layer", "forget_multilayer_mse", "forget_readout_grid", "forget_readout_grid_shared",
           "forget_readout_mse_shared", "gated_layer", "gated_multilayer_mse_grid", "gated_multilayer_mse_grids",
           "gated_query_mse_grid", "subsequence_positions"]


def _native(backend: str | None) -> bool:
    return (_backend_in_force() if backend is None else resolve_backend(backend)) == "native"


def forget_layer(Z, WQ, WK, WV, lam, *, backend: str | None = None):
    """Outputs o_t at every position of one layer with a forget factor: S_t = λ S_{t−1} + v_t k_tᵀ, o_t = S_t q_t,
    q_t = W_Q z_t, k_t = W_K z_t, v_t = W_V z_t (the drift paper's eqs 5-6).

    Args:
        Z: (..., T, D) tokens; WQ, WK, WV: (D, D); lam: λ (a scalar).
        backend: ``native`` (compiled kernels, a custom VJP), ``xla`` (:func:`.naive.forget_layer`), ``auto``;
            None: the backend in force.
    Returns:
        O: Z's shape.
    """
    return (forget.forget_layer if _native(backend) else naive.forget_layer)(Z, WQ, WK, WV, lam)


def gated_layer(Z, weights, *, backend: str | None = None):
    """Outputs o_t at every position of one scalar-gated layer: S_t = σ(w_gᵀz_t) S_{t−1} + v_t k_tᵀ, o_t = S_t q_t,
    q_t = W_qᵀ z_t (the gating paper's eq GLA with a scalar gate, Thm 4).

    Args:
        Z: (..., T, D) tokens; weights: ``{"Wq", "Wk", "Wv"}`` (D, D) and ``"w_g"`` (D,).
        backend: as :func:`forget_layer`'s.
    Returns:
        O: Z's shape.
    """
    return gated.gated_layer(weights, Z) if _native(backend) else naive.gated_layer(Z, weights)


def forget_readout_grid(Z, u, c, lam, *, backend: str | None = None):
    """Predictions at the query of a (G, K) grid of one-layer models on the prompts of their rows:
    ŷ_gkb = Σ_t λ_gk^{T−1−t} (u_gk·z_gbt)(c_gkb·z_gbt) (u = (W_V)_{d+1,:}, c = W_Kᵀ W_Q z_q).

    Args:
        Z: (G, B, T, D); u: (G, K, D); c: (G, K, B, D); lam: (G, K).
        backend: as :func:`forget_layer`'s.
    Returns:
        (G, K, B) predictions.
    """
    return (forget.readout_grid if _native(backend) else naive.forget_readout_grid)(Z, u, c, lam)


def forget_multilayer_mse(Z, y, WQ, WK, WV, lam, *, backend: str | None = None):
    """Mean squared error on one batch of an L-layer residual model with a forget factor λ shared by its layers
    (the drift paper's deep GLA): layers 1..L−1 at every position, the last read at the query.

    Args:
        Z: (B, T, D) tokens, the query last; y: (B,) targets; WQ, WK, WV: (L, D, D); lam: λ.
        backend: as :func:`forget_layer`'s (native: the whole model and its gradient in one host call).
    Returns:
        The scalar loss.
    """
    return (forget.multilayer_mse if _native(backend) else naive.forget_multilayer_mse)(Z, y, WQ, WK, WV, lam)