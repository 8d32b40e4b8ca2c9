"""The decoder: causality, KV-cache decoding, meta construction, init."""

from __future__ import annotations

import pytest
import torch

from memlm.model import ModelArgs, Transformer, build_model
from memlm.model.rope import apply_rope, rope_cos_sin


def _model(**kw) -> Transformer:
    args = ModelArgs(**{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 97,
                        "multiple_of": 32, "max_seq_len": 64, **kw})
    return build_model(args, seed=0).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_causality(tie):
    model = _model(tie_embeddings=tie)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    base = model(tokens)
    for t in (0, 7, 23):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 97
        out = model(changed)
        assert torch.equal(out[:, :t], base[:, :t]), f"logits before position {t} changed"
        assert not torch.allclose(out[:, t], base[:, t]), "the changed position itself must change"


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_kv_cache_matches_full_forward(kv_heads):
    model = _model(n_kv_heads=kv_heads)
    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    full = model(tokens)
    cache = model.new_cache(batch=3, max_len=20)
    # A 5-token prompt, then a 3-token chunk, then one token at a time.
    steps = [model(tokens[:, :5], cache=cache), model(tokens[:, 5:8], cache=cache)]
    steps += [model(tokens[:, t:t + 1], cache=cache) for t in range(8, 20)]
    incremental = torch.cat(steps, dim=1)
    assert cache.pos == 20
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = _model(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_rope_rotation_preserves_norm_and_is_relative():
    cos, sin = rope_cos_sin(8, 32, 10000.0)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    cos, sin = cos.double(), sin.double()

    def rot(x, p):
        return apply_rope(x, cos[p:p + 1], sin[p:p + 1])

    assert torch.allclose(rot(q, 5).norm(), q.norm())
    # q_m . k_n depends only on m - n.
    d1 = (rot(q, 9) * rot(k, 4)).sum()
    d2 = (rot(q, 20) * rot(k, 15)).sum()
    assert torch.allclose(d1, d2)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_meta_construction_allocates_no_memory():
    from memlm.config.run import compose

    cfg = compose(["model=8b"])
    before = _rss_bytes()
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    grown = _rss_bytes() - before
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.is_meta for t in tensors)
    # 8B fp32 parameters would be 32 GB; only Python objects may have been created.
    assert grown < 200 * 2**20, f"meta construction grew RSS by {grown / 2**20:.0f} MiB"
    assert model.num_params()["total"] > 8_000_000_000


def test_init_is_seeded_and_depth_scaled():
    a, b = _model(n_layers=4), _model(n_layers=4)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    std0 = a.layers[0].attention.wo.weight.std().item()
    std3 = a.layers[3].attention.wo.weight.std().item()
    # out_std = 0.02 / sqrt(2 (layer + 1)): layer 3 is 2x smaller than layer 0.
    assert std0 / std3 == pytest.approx(2.0, rel=0.15)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))


def test_training_step_reduces_loss(tiny_model):
    model = tiny_model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, model.args.vocab_size, (4, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
