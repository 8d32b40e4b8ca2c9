"""Parameter and FLOP accounting of the presets, against numbers computed by hand."""

from __future__ import annotations

import pytest
import torch

from memlm.config.run import compose
from memlm.model import Transformer


def _meta(preset: str) -> Transformer:
    cfg = compose([f"model={preset}"])
    with torch.device("meta"):
        return Transformer(cfg.model, cfg.memory)


# Per layer: attention dim*(n_heads + 2*kv_heads)*head_dim + dim*dim, SwiGLU 3*dim*hidden,
# two norms 2*dim; plus the final norm; embeddings vocab*dim, twice when untied.
# tiny : hidden=192 (int(8*64/3)=170 -> multiple of 32), kv 2 of 4 heads
#        layer = 64*(4+4)*16 + 64*64 + 3*64*192 + 128 = 8192 + 4096 + 36864 + 128 = 49280
# 134m : hidden 2048; layer = 4*768^2 + 3*768*2048 + 1536 = 7,079,424
# 373m : hidden 2816 (2730 -> multiple of 256); layer = 4*1024^2 + 3*1024*2816 + 2048 = 12,847,104
# 1b   : hidden 5632 (5461 -> 256); layer = 4*2048^2 + 3*2048*5632 + 4096 = 51,384,320
# 8b   : hidden 14336 (int(1.3*10922)=14198 -> 1024); layer = 2*4096^2 + 2*4096*1024
#        + 3*4096*14336 + 8192 = 218,112,000 (Llama 3 8B: 8.03B in total)
EXPECTED = {
    "tiny": dict(dense=2 * 49_280 + 64, embedding=2 * 512 * 64),
    "134m": dict(dense=12 * 7_079_424 + 768, embedding=2 * 32_000 * 768),
    "373m": dict(dense=24 * 12_847_104 + 1024, embedding=2 * 32_000 * 1024),
    "1b": dict(dense=25 * 51_384_320 + 2048, embedding=2 * 32_000 * 2048),
    "8b": dict(dense=32 * 218_112_000 + 4096, embedding=2 * 128_256 * 4096),
}
TOTALS = {"tiny": 164_160, "134m": 134_105_856, "373m": 373_867_520, "1b": 1_415_682_048, "8b": 8_030_261_248}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_parameter_counts(preset):
    counts = _meta(preset).num_params()
    exp = EXPECTED[preset]
    assert counts["dense"] == exp["dense"]
    assert counts["embedding"] == exp["embedding"]
    assert counts["memory"] == 0
    assert counts["total"] == counts["active"] == TOTALS[preset] == exp["dense"] + exp["embedding"]


def test_tied_embeddings_count_once():
    cfg = compose(["model.tie_embeddings=true"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assert model.num_params()["embedding"] == 512 * 64


def test_flops_per_token_373m():
    model = _meta("373m")
    d, h, v, s = 1024, 2816, 32_000, 2048
    per_layer = 2 * 4 * d * d + 2 * 16 * 64 * (s + 1) + 2 * 3 * d * h
    assert model.flops_per_token(s) == 24 * per_layer + 2 * d * v
    # The common 6N rule of thumb (N = non-embedding params) is close for the matmul part.
    assert model.flops_per_token(s) == pytest.approx(2 * 308_330_496 + 2 * d * v + 24 * 2 * 16 * 64 * (s + 1), rel=1e-3)


def test_describe_command_prints_counts(capsys):
    from memlm.plan import describe

    describe.main(["--all-presets"])
    out = capsys.readouterr().out
    for preset, total in TOTALS.items():
        assert preset in out and f"{total:,}" in out
