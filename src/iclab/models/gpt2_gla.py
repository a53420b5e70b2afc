"""GPT-2 with its softmax attention swapped for causal linear attention or GLA with a forget factor.

The drift paper (Sec 5.3) fine-tunes GPT-2 small with every attention layer replaced by linear
attention (LinearGPT2) or by gated linear attention with a forget factor (GatedLinearGPT2). Per
head, with q_t, k_t, v_t the rows of GPT-2's own projections (``c_attn``) and φ a feature map:

    S_t = g_t S_{t-1} + φ(k_t) v_tᵀ,   z_t = g_t z_{t-1} + 1,   o_t = S_tᵀ φ(q_t) · s / (z_t if normalised),

S_0 = 0, z_0 = 0, s = 1/√d_head (GPT-2's score scale), then GPT-2's output projection ``c_proj``.
Parallel form: O = (D ⊙ φ(Q)φ(K)ᵀ s) V, D_{t,u} = Π_{l=u+1..t} g_l for u ≤ t (0 above the
diagonal), rows divided by Σ_u D_{t,u} when normalised. The gates g_t come from ONE forget factor
λ ∈ (0, 1] per layer (the paper's "λ" is a scalar; granularity is our choice):

- ``token``: g_t = λ at every token, so a token k positions back weighs λ^k;
- ``demonstration``: g_t = λ at the first token of each demonstration (segment) and 1 elsewhere,
  so a whole demonstration k demonstrations back weighs λ^k. (A token-level λ = 0.9 remembers about
  ten tokens (0.9^200 ≈ 7·10⁻¹⁰), far short of 20 demonstrations of ~25 tokens.)

λ = 1 gives exactly causal linear attention in both granularities. The paper's eq 5 has no feature
map and no normaliser; both are options here (``feature_map="identity"``, ``normalize``).

This module needs torch and transformers (``pip install -e '.[llm]'``); it is imported only by
the GPT-2 experiments. ``gla_parallel`` is the fast path, ``gla_recurrent`` the naive per-token
reference beside it (tests compare outputs and gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

__all__ = ["FeatureMap", "GatedLinearAttention", "Granularity", "decay_mask", "demonstration_segments", "feature",
           "gla_parallel", "gla_recurrent", "log_gates", "swap_attention"]

Granularity = Literal["token", "demonstration"]
FeatureMap = Literal["identity", "elu1"]


def feature(x: torch.Tensor, feature_map: FeatureMap) -> torch.Tensor:
    """φ(x): identity (the paper's eq 5) or elu(x) + 1 (positive features, Katharopoulos et al.).

    Args:
        x: any tensor; feature_map: "identity" or "elu1".
    Returns:
        φ(x), same shape.
    """
    if feature_map == "identity":
        return x
    if feature_map == "elu1":
        return nn.functional.elu(x) + 1.0
    raise ValueError(f"feature_map must be identity or elu1 (got {feature_map!r})")


def log_gates(lam: float, segment_ids: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """log g_t (B, T) for one forget factor λ.

    ``token``: log λ everywhere; ``demonstration``: log λ where a new segment starts (t > 0 with
    segment_ids[t] ≠ segment_ids[t-1]), 0 elsewhere. g_0 never matters (S_{-1} = 0).

    Args:
        lam: the forget factor λ ∈ (0, 1].
        segment_ids: (B, T) integers numbering the demonstrations.
        granularity: "token" or "demonstration".
    Returns:
        (B, T) float32 log gates.
    """
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"forget factor λ must be in (0, 1] (got {lam})")
    log_lam = torch.log(torch.tensor(lam, dtype=torch.float64)).item()
    if granularity == "token":
        return torch.full(segment_ids.shape, log_lam, dtype=torch.float32, device=segment_ids.device)
    if granularity == "demonstration":
        starts = torch.zeros(segment_ids.shape, dtype=torch.bool, device=segment_ids.device)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        return starts.to(torch.float32) * log_lam
    raise ValueError(f"granularity must be token or demonstration (got {granularity!r})")


def decay_mask(log_g: torch.Tensor) -> torch.Tensor:
    """The decay matrix D_{t,u} = exp(Σ_{l=u+1..t} log g_l) for u ≤ t, 0 above the diagonal.

    Args:
        log_g: (B, T) log gates.
    Returns:
        (B, T, T).
    """
    c = torch.cumsum(log_g, dim=-1)
    diff = c[..., :, None] - c[..., None, :]
    T = log_g.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=log_g.device).tril()
    # Masked before exp: above the diagonal diff > 0 can overflow.
    return torch.where(causal, torch.exp(torch.where(causal, diff, torch.zeros_like(diff))), torch.zeros_like(diff))


def gla_parallel(q, k, v, log_g, *, scale: float = 1.0, normalize: bool = True,
                 feature_map: FeatureMap = "identity") -> torch.Tensor:
    """Parallel form O = (D ⊙ φ(Q)φ(K)ᵀ s) V (rows / Σ_u D_{t,u} if normalised).

    Args:
        q, k, v: (B, H, T, d_head); log_g: (B, T) log gates (see :func:`log_gates`).
        scale: the score scale s; normalize: divide by Σ_u D_{t,u}; feature_map: φ.
    Returns:
        (B, H, T, d_head).
    """
    D = decay_mask(log_g.to(q.dtype))[:, None]  # (B, 1, T, T)
    scores = feature(q, feature_map) @ feature(k, feature_map).transpose(-1, -2) * scale
    out = (D * scores) @ v
    if normalize:
        out = out / D.sum(dim=-1, keepdim=True)
    return out


def gla_recurrent(q, k, v, log_g, *, scale: float = 1.0, normalize: bool = True,
                  feature_map: FeatureMap = "identity") -> torch.Tensor:
    """Naive reference: the state recursion S_t = g_t S_{t-1} + φ(k_t)v_tᵀ, one token at a time.

    Args:
        q, k, v, log_g, scale, normalize, feature_map: as :func:`gla_parallel`.
    Returns:
        (B, H, T, d_head), equal to :func:`gla_parallel` (tests compare outputs and gradients).
    """
    B, H, T, dh = q.shape
    fq, fk = feature(q, feature_map), feature(k, feature_map)
    S = q.new_zeros(B, H, dh, v.shape[-1])
    z = q.new_zeros(B, 1, 1)
    outs = []
    for t in range(T):
        g = torch.exp(log_g[:, t].to(q.dtype))[:, None, None]  # (B, 1, 1)
        S = g[..., None] * S + fk[:, :, t, :, None] * v[:, :, t, None, :]
        z = g * z + 1.0
        o = torch.einsum("bhd,bhde->bhe", fq[:, :, t], S) * scale
        outs.append(o / z if normalize else o)
    return torch.stack(outs, dim=2)


class GatedLinearAttention(nn.Module):
    """Drop-in replacement of a GPT-2 attention layer (reuses its ``c_attn``/``c_proj`` weights).

    Set ``segment_ids`` (B, T) through :func:`demonstration_segments` before a forward pass when
    ``granularity="demonstration"``; ``token`` needs none. Padding must be on the right: causal
    attention never lets a pad token reach an earlier position, so no attention mask is used.
    """

    def __init__(self, attn: nn.Module, lam: float, granularity: Granularity = "demonstration",
                 normalize: bool = True, feature_map: FeatureMap = "identity"):
        super().__init__()
        if not 0.0 < lam <= 1.0:
            raise ValueError(f"forget factor λ must be in (0, 1] (got {lam})")
        self.c_attn, self.c_proj = attn.c_attn, attn.c_proj
        self.attn_dropout, self.resid_dropout = attn.attn_dropout, attn.resid_dropout
        self.num_heads, self.head_dim, self.embed_dim = attn.num_heads, attn.head_dim, attn.embed_dim
        self.scale = float(attn.scaling) if hasattr(attn, "scaling") else self.head_dim ** -0.5
        self.layer_idx = getattr(attn, "layer_idx", None)
        self.lam, self.granularity, self.normalize, self.feature_map = float(lam), granularity, normalize, feature_map
        self.segment_ids: torch.Tensor | None = None

    def extra_repr(self) -> str:
        """λ, granularity, normaliser and feature map, for ``print(model)``."""
        return (f"λ={self.lam}, granularity={self.granularity}, normalize={self.normalize}, "
                f"feature_map={self.feature_map}")

    def forward(self, hidden_states, *args, **kwargs):
        """GPT-2's attention call: returns (output (B, T, E), None).

        Args:
            hidden_states: (B, T, E); other arguments of GPT-2's attention are accepted and ignored.
        """
        B, T, _ = hidden_states.shape
        q, k, v = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        q, k, v = (x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for x in (q, k, v))
        seg = self.segment_ids
        if seg is None:
            if self.granularity == "demonstration" and self.lam < 1.0:
                raise RuntimeError("demonstration-level gating needs segment ids: wrap the call in "
                                   "demonstration_segments(model, segment_ids)")
            seg = torch.zeros(B, T, dtype=torch.long, device=hidden_states.device)
        out = gla_parallel(q, k, v, log_gates(self.lam, seg[:, :T], self.granularity), scale=self.scale,
                           normalize=self.normalize, feature_map=self.feature_map)
        out = out.transpose(1, 2).reshape(B, T, self.embed_dim)
        return self.resid_dropout(self.c_proj(out)), None


def _blocks(model: nn.Module):
    body = getattr(model, "transformer", model)  # GPT2LMHeadModel or GPT2Model
    return body.h


def swap_attention(model: nn.Module, lam: float | Sequence[float] = 1.0, granularity: Granularity = "demonstration",
                   normalize: bool = True, feature_map: FeatureMap = "identity") -> nn.Module:
    """Replaces every attention layer of a GPT-2 (in place) by :class:`GatedLinearAttention`.

    Args:
        model: a GPT2LMHeadModel or GPT2Model.
        lam: one forget factor for every layer, or one per layer; λ = 1 everywhere is LinearGPT2.
        granularity, normalize, feature_map: as :class:`GatedLinearAttention`.
    Returns:
        The model.
    """
    blocks = _blocks(model)
    lams = [float(lam)] * len(blocks) if isinstance(lam, (int, float)) else [float(x) for x in lam]
    if len(lams) != len(blocks):
        raise ValueError(f"lam must give one value per layer ({len(blocks)}; got {len(lams)})")
    for block, lam_l in zip(blocks, lams):
        block.attn = GatedLinearAttention(block.attn, lam_l, granularity, normalize, feature_map)
    return model


@contextlib.contextmanager
def demonstration_segments(model: nn.Module, segment_ids: torch.Tensor):
    """Within the block, every swapped layer of ``model`` gates by these segment ids.

    Args:
        model: a model passed through :func:`swap_attention`.
        segment_ids: (B, T) integers numbering the demonstrations of each prompt.
    """
    layers = [b.attn for b in _blocks(model) if isinstance(b.attn, GatedLinearAttention)]
    for layer in layers:
        layer.segment_ids = segment_ids
    try:
        yield model
    finally:
        for layer in layers:
            layer.segment_ids = None
