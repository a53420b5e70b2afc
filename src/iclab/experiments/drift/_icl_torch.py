"""The pieces shared by drift.gpt2 and drift.gpt2-offline: in-context classification with (gated)
linear GPT-2s in torch.

A batch is a :class:`ICLBatch`: model inputs (token ids or input embeddings), segment ids (one per
demonstration, for demonstration-level gating), and the positions whose next-token logits predict a
label (``label_pos``) with the label class there (``label_cls``, -1 for padding). Training is AdamW
on the cross-entropy at those positions; evaluation reads the query's label probabilities (softmax
over the label tokens only) and reports accuracy and confidence (Sec 5.3: the mean, over CORRECT
predictions only, of the largest label probability).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from iclab.models import gpt2_gla


@dataclass
class ICLBatch:
    """One batch of prompts, right-padded to a common length T.

    Attributes:
        inputs: ``input_ids`` (B, T) long, or ``inputs_embeds`` (B, T, E).
        segment_ids: (B, T) long, the demonstration each token belongs to (the query: last).
        label_pos: (B, M) long, positions whose output predicts a label; the query's is column -1.
        label_cls: (B, M) long, the label class (index into the label tokens); -1 marks padding.
    """

    inputs: torch.Tensor
    segment_ids: torch.Tensor
    label_pos: torch.Tensor
    label_cls: torch.Tensor


def label_metrics(label_logits: np.ndarray, labels: np.ndarray) -> dict:
    """Accuracy and confidence from the label logits (N, C) of N queries and their classes (N,).

    Confidence (Sec 5.3): mean over correctly classified queries of max_c p_c, p = softmax
    over the C label logits; it lies in [1/C, 1]. NaN when nothing is correct."""
    z = label_logits - label_logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    pred = p.argmax(axis=1)
    correct = pred == labels
    conf = float(p.max(axis=1)[correct].mean()) if correct.any() else float("nan")
    return {"accuracy": float(correct.mean()), "confidence": conf, "correct": correct,
            "n_correct": int(correct.sum())}


def forward_logits(model, batch: ICLBatch, embeds: bool) -> torch.Tensor:
    """The model's output (B, T, ·) on a batch, with its demonstration segments set."""
    kw = {"inputs_embeds": batch.inputs} if embeds else {"input_ids": batch.inputs}
    with gpt2_gla.demonstration_segments(model, batch.segment_ids):
        out = model(**kw, use_cache=False)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def gather_positions(out: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out (B, T, V) at positions pos (B, M) -> (B, M, V)."""
    return torch.gather(out, 1, pos[..., None].expand(-1, -1, out.shape[-1]))


def classification_loss(model, batch: ICLBatch, readout: Callable, loss_on: str, label_space: str,
                        lm_label_ids: list[int] | None, embeds: bool) -> torch.Tensor:
    """Mean cross-entropy at the label positions: every labelled position (``all``) or the query's only.

    ``label_space``: ``vocab`` (the LM's full next-token distribution, the label token as target) or
    ``labels`` (softmax over the C label tokens)."""
    h = gather_positions(forward_logits(model, batch, embeds), batch.label_pos)  # (B, M, V)
    cls = batch.label_cls
    if loss_on == "query":
        h, cls = h[:, -1:], cls[:, -1:]
    if lm_label_ids is not None and label_space == "vocab":
        ids = torch.as_tensor(lm_label_ids, device=cls.device)
        target = torch.where(cls >= 0, ids[cls.clamp(min=0)], torch.full_like(cls, -100))
        return torch.nn.functional.cross_entropy(h.reshape(-1, h.shape[-1]), target.reshape(-1), ignore_index=-100)
    logits = readout(h)  # (B, M, C)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), cls.reshape(-1), ignore_index=-1)


def train_adamw(params, loss_fn: Callable[[int], torch.Tensor], steps: int, *, lr: float, weight_decay: float,
                betas: tuple[float, float], callback=None, record_every: int = 1) -> np.ndarray:
    """AdamW (decoupled weight decay, torch's) for ``steps`` steps of ``loss_fn(step)``; returns the
    recorded training losses (one per ``record_every`` steps)."""
    opt = torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, betas=betas)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(step)
        loss.backward()
        opt.step()
        if step % record_every == 0 or step == steps - 1:
            losses.append(float(loss.detach()))
            if not np.isfinite(losses[-1]):
                raise FloatingPointError(f"training loss became {losses[-1]} at step {step}")
        if callback is not None:
            callback(step + 1, {"loss": float(loss.detach())})
    return np.asarray(losses)


@torch.no_grad()
def query_label_logits(model, batches, readout: Callable, embeds: bool) -> np.ndarray:
    """Label logits (N, C) at the query position of every prompt in ``batches`` (an iterable)."""
    was_training = model.training
    model.eval()
    out = []
    for batch in batches:
        h = gather_positions(forward_logits(model, batch, embeds), batch.label_pos[:, -1:])[:, 0]
        out.append(readout(h).double().cpu().numpy())
    model.train(was_training)
    return np.concatenate(out)


def paired_accuracy_z(correct_a: np.ndarray, correct_b: np.ndarray) -> tuple[float, float]:
    """(mean difference of accuracies a − b on the same prompts, its z-score from the paired SE)."""
    diff = correct_a.astype(float) - correct_b.astype(float)
    se = diff.std(ddof=1) / np.sqrt(diff.size) if diff.size > 1 else float("nan")
    mean = float(diff.mean())
    return mean, (mean / se if se > 0 else (np.inf if mean > 0 else (0.0 if mean == 0 else -np.inf)))


def seed_everything(seed: int) -> torch.Generator:
    """A seeded torch generator (and torch's global seed, which module init uses)."""
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def variant_name(lam) -> str:
    """LinearGPT2 for λ = 1 everywhere, else GatedLinearGPT2(λ) (per-layer values listed)."""
    lams = [lam] if isinstance(lam, (int, float)) else list(lam)
    if all(x == 1.0 for x in lams):
        return "LinearGPT2 (λ = 1)"
    return f"GatedLinearGPT2 (λ = {lams[0]:g})" if len(lams) == 1 else f"GatedLinearGPT2 (λ = {','.join(f'{x:g}' for x in lams)})"
