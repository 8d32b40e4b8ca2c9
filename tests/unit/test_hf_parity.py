"""Our decoder against transformers' LlamaForCausalLM loaded with the same weights."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from memlm.hf.mapping import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict  # noqa: E402
from memlm.model import ModelArgs, build_model  # noqa: E402

ARGS = dict(dim=64, n_layers=3, n_heads=4, vocab_size=101, multiple_of=16, max_seq_len=64, rope_theta=5000.0)


def _hf_model(config):
    model = transformers.LlamaForCausalLM(config).eval()
    return model.float()


@pytest.mark.parametrize("kv_heads,tie", [(0, False), (2, False), (1, True)])
def test_export_to_transformers_gives_same_logits(kv_heads, tie):
    args = ModelArgs(**ARGS, n_kv_heads=kv_heads, tie_embeddings=tie)
    ours = build_model(args, seed=0).eval()
    # Random norms too, so a swapped norm mapping cannot pass.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf = _hf_model(to_hf_config(args))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_import_from_transformers_gives_same_logits():
    config = transformers.LlamaConfig(
        vocab_size=89, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32,
        rope_theta=20000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    hf = _hf_model(config)
    args = from_hf_config(config)
    assert (args.dim, args.kv_heads, args.hidden_dim, args.rope_theta) == (48, 3, 80, 20000.0)
    ours = build_model(args, seed=5).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), args))
    tokens = torch.randint(0, 89, (3, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_round_trip_state_dict_is_identity():
    args = ModelArgs(**ARGS)
    sd = build_model(args, seed=3).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, args), args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_memory_models_are_refused():
    from memlm.hf.mapping import _check_dense
    from memlm.memory.config import MemoryConfig

    args = ModelArgs(**ARGS, ffn="dense")
    engram = MemoryConfig()
    engram.engram.layers = [0]
    for memory in (MemoryConfig(kind="memplus"), engram):
        with pytest.raises(ValueError, match="only dense models"):
            _check_dense(args, memory)
    _check_dense(args, MemoryConfig())  # memory.kind=none and no Engram: a Llama
