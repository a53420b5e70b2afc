"""GPT-2 attention swap (drift Sec 5.3): parallel vs naive recurrence, λ = 1 = linear attention,
and the swapped model on a tiny random-init GPT-2 (shapes, causality, gating by demonstrations)."""

import itertools

import pytest
import torch

from iclab.models import gpt2_gla as g


def _qkv(B=2, H=3, T=7, dh=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, dh, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]


SEGMENTS = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [0, 1, 2, 3, 3, 3, 4]])


@pytest.mark.parametrize("lam,granularity,normalize,feature_map",
                         list(itertools.product([1.0, 0.9, 0.3], ["token", "demonstration"], [True, False],
                                                ["identity", "elu1"])))
def test_parallel_equals_recurrent_outputs_and_gradients(lam, granularity, normalize, feature_map):
    q, k, v = _qkv()
    lg = g.log_gates(lam, SEGMENTS, granularity).double()
    kw = dict(scale=0.5, normalize=normalize, feature_map=feature_map)
    a = g.gla_parallel(q, k, v, lg, **kw)
    b = g.gla_recurrent(q, k, v, lg, **kw)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(a)
    ga = torch.autograd.grad((a * w).sum(), (q, k, v))
    gb = torch.autograd.grad((b * w).sum(), (q, k, v))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


def test_lambda_one_is_causal_linear_attention():
    q, k, v = _qkv()
    T = q.shape[2]
    # Independent loop: o_t = Σ_{u≤t} (q_t·k_u) s v_u / (t + 1).
    ref = torch.stack([sum((q[:, :, t] * k[:, :, u]).sum(-1, keepdim=True) * 0.5 * v[:, :, u] for u in range(t + 1))
                       / (t + 1) for t in range(T)], dim=2)
    for gran in ("token", "demonstration"):
        out = g.gla_parallel(q, k, v, g.log_gates(1.0, SEGMENTS, gran).double(), scale=0.5)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_decay_mask_is_products_of_gates():
    lg = torch.log(torch.tensor([[0.5, 0.9, 0.8, 0.7]], dtype=torch.float64))
    D = g.decay_mask(lg)[0]
    gates = torch.exp(lg[0])
    for t, u in itertools.product(range(4), range(4)):
        want = torch.prod(gates[u + 1:t + 1]) if u <= t else torch.tensor(0.0, dtype=torch.float64)
        assert D[t, u].item() == pytest.approx(want.item(), rel=1e-14, abs=0)


def test_demonstration_gates_decay_once_per_demonstration():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2]])
    lg = g.log_gates(0.5, seg, "demonstration")
    assert torch.allclose(torch.exp(lg), torch.tensor([[1.0, 1.0, 1.0, 0.5, 1.0, 0.5]]))
    with pytest.raises(ValueError, match="λ must be in"):
        g.log_gates(0.0, seg, "token")


@pytest.fixture(scope="module")
def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _swapped(base, **kw):
    import copy

    return g.swap_attention(copy.deepcopy(base), **kw)


def test_swapped_gpt2_shapes_and_causality(tiny_gpt2):
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    seg = torch.arange(12).div(4, rounding_mode="floor").expand(3, 12)
    model = _swapped(tiny_gpt2, lam=0.7, granularity="demonstration")
    assert all(isinstance(b.attn, g.GatedLinearAttention) for b in model.transformer.h)
    with torch.no_grad(), g.demonstration_segments(model, seg):
        a = model(ids, use_cache=False).logits
        ids2 = ids.clone()
        ids2[:, 8:] = (ids2[:, 8:] + 1) % 50
        b = model(ids2, use_cache=False).logits
    assert a.shape == (3, 12, 50)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-12, atol=1e-12)  # the future does not leak
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def test_lambda_one_gpt2_is_linear_gpt2_in_both_granularities(tiny_gpt2):
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    seg = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 3, 3, 3]] * 2)
    la = _swapped(tiny_gpt2, lam=1.0, granularity="token")
    gla1 = _swapped(tiny_gpt2, lam=1.0, granularity="demonstration")
    gla = _swapped(tiny_gpt2, lam=[0.5, 0.9], granularity="demonstration")
    with torch.no_grad():
        a = la(ids, use_cache=False).logits
        with g.demonstration_segments(gla1, seg):
            b = gla1(ids, use_cache=False).logits
        with g.demonstration_segments(gla, seg):
            c = gla(ids, use_cache=False).logits
        with g.demonstration_segments(gla, torch.zeros_like(seg)):  # one segment: no gate ever fires
            d = gla(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a[:, :2], c[:, :2], rtol=1e-12, atol=1e-12)  # first demonstration: no decay yet
    assert (a[:, 2:] - c[:, 2:]).abs().max() > 1e-7  # far above the 1e-12 agreement; init std 0.02 keeps it small
    # Per-layer λ went to the right layers.
    assert [blk.attn.lam for blk in gla.transformer.h] == [0.5, 0.9]


def test_demonstration_gating_without_segments_is_an_error(tiny_gpt2):
    model = _swapped(tiny_gpt2, lam=0.9, granularity="demonstration")
    with pytest.raises(RuntimeError, match="segment ids"):
        model(torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    with pytest.raises(ValueError, match="one value per layer"):
        _swapped(tiny_gpt2, lam=[0.9, 0.9, 0.9])
