"""Non-dense exports in transformers: the trust_remote_code modeling file against memlm.

The modeling file (hf/remote/modeling_memlm.py) re-implements memlm's
decoder and every FFN kind in plain PyTorch; these tests keep the two equal:
- logits equal to memlm's (0.0) for each memory kind and its variants (gates, shared
  or own value tables, qk-norm, W1/W2 biases, parallel placement, bf16 tables, v_dim != dim,
  PEER, UltraMemV2, mixed kinds), and within 1e-5 for MoE (its per-expert loop sums
  in another order than memlm's grouped GEMM); greedy generate() equal to memlm's
  greedy decoding, left-padded batches equal to unpadded rows (within 1e-5: another
  computation than the full recompute);
- every ModelArgs / MemoryConfig field and every registered FFN kind is mapped
  or declared training-only (a new field or kind fails here first);
- a real export loads through AutoModelForCausalLM + auto_map in a
  subprocess where `import memlm` is blocked (the CI check), and, when
  MEMLM_REMOTE_PYTHON names the python of a fresh venv without memlm
  (docs/checkpoints.md shows how to make one), in that venv too.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from hf_remote_child import TOL, run_remote_child  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from memlm.hf import remote as hf_remote  # noqa: E402
from memlm.hf.remote.modeling_memlm import MemlmForCausalLM  # noqa: E402
from memlm.memory.config import MemoryConfig  # noqa: E402
from memlm.memory.engram_config import EngramConfig  # noqa: E402
from memlm.model import ModelArgs, build_model, families  # noqa: E402

ARGS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=16, max_seq_len=64,
            rope_theta=5000.0)
PKM = dict(n_keys=8, knn=4, eval_knn=3, heads=2, k_dim=16)
CASES = {
    "memplus_shared_swilu": ({}, dict(kind="memplus", layers=[1], **PKM)),
    "memplus_own_values_sigmoid_qknorm": (
        {}, dict(kind="memplus", layers=[0, 2], share_values=False, gate="sigmoid", qk_norm=True, **PKM)),
    "memplus_w_bias_sigmoid": ({}, dict(kind="memplus", layers=[1], gate="sigmoid", w_bias=True, **PKM)),
    "memplus_nogate_parallel_bf16_tied": (
        dict(tie_embeddings=True, n_kv_heads=0),
        dict(kind="memplus", layers=[1], gate="none", placement="parallel", value_dtype="bf16", **PKM)),
    "memory_shared": ({}, dict(kind="memory", layers=[0, 1], **PKM)),
    "memory_vdim_outproj": ({}, dict(kind="memory", layers=[1], v_dim=32, **PKM)),
    "moe_layer": ({}, dict(kind="moe", layers=[1], n_experts=4, top_k=2)),
    "moe_everywhere": (dict(ffn="moe"), None),
    "peer_qknorm": ({}, dict(kind="peer", layers=[1], n_keys=8, knn=4, heads=2, k_dim=16, qk_norm=True)),
    "memplus_and_peer": (dict(ffn="memplus"), dict(kind="peer", layers=[1], **PKM)),
    "ultramem_every_block": ({}, dict(kind="ultramem", layers=[0, 1, 2], n_keys=8, knn=6, heads=1, k_dim=16)),
    "engram_alone": ({}, dict(kind="none", engram=EngramConfig(layers=[1], heads=2, head_dim=8, rows_per_head=50))),
    "engram_beside_memplus": ({}, dict(kind="memplus", layers=[1], **PKM, engram=EngramConfig(
        layers=[0, 2], max_order=4, heads=3, head_dim=4, rows_per_head=40, kernel_size=3, dilation=2, hash_seed=5))),
    "ultramem_expanded_two_heads": ({}, dict(kind="ultramem", layers=[1], n_keys=8, knn=4, heads=2, k_dim=16,
                                             rank=3, expansion=4, candidates=5, v_dim=24, pre_dim=8,
                                             ffn_fraction=0.0)),
}
# MoE's per-expert loop sums in another order than memlm's grouped GEMM: within TOL, not equal.
SUMMED_OTHERWISE = {"moe_layer", "moe_everywhere"}


def _memlm_model(args_kw: dict, mem_kw: dict | None, seed: int = 0):
    args = ModelArgs(**{**ARGS, **args_kw})
    memory = MemoryConfig(**mem_kw) if mem_kw is not None else None
    model = build_model(args, memory, seed=seed).eval()
    # Norms and biases away from their init (ones, zeros), so a weight the
    # modeling file dropped or swapped cannot go unnoticed.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif ".engram.norm_" in name or name.endswith(".engram.conv"):  # Engram's norms (ones), conv (zeros)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if "norm_" in name else 0.0))
        for block in model.layers:  # a map that merges tokens, as a tokenizer's does (not the identity)
            if block.engram is not None:
                block.engram.hash.token_map.copy_(torch.arange(args.vocab_size) % 37)
    return model, args, memory


def _bundle(tmp_path: Path, model, args, memory) -> Path:
    """What run/export.py writes for a non-dense model, minus the checkpoint round trip."""
    out = tmp_path / "bundle"
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    hf_remote.write_remote_code(out, args, memory, extra={"bos_token_id": 7})
    return out


def _tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, ARGS["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_remote_model_logits_match_memlm(tmp_path, case):
    ours, args, memory = _memlm_model(*CASES[case])
    hf = MemlmForCausalLM.from_pretrained(str(_bundle(tmp_path, ours, args, memory))).eval()
    assert set(hf.state_dict()) == set(ours.state_dict())
    assert hf.config.bos_token_id == 7  # extra config.json keys reach the config
    tokens = _tokens(2, 24)
    with torch.no_grad():
        logits, out = ours(tokens), hf(tokens, labels=tokens)
    diff = (logits - out.logits).abs().max().item()
    if case in SUMMED_OTHERWISE:
        assert diff <= TOL, f"{case}: max |logit difference| {diff}"
    else:
        assert diff == 0.0, f"{case}: max |logit difference| {diff}"
    # Hugging Face's convention: labels are the inputs, the model shifts them.
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(out.loss.item() - expected.item()) <= TOL
    # `.float()` (a habit with HF models) must not change the math: a bf16
    # value table goes back to its storage dtype (memory.value_dtype) at the next read.
    with torch.no_grad():
        assert (logits - hf.float()(tokens).logits).abs().max().item() <= (TOL if case in SUMMED_OTHERWISE else 0.0)


def test_a_cropped_cache_decodes_as_if_the_dropped_positions_never_ran(tmp_path):
    """Assisted decoding runs candidate tokens through the model, then crops the cache back to the ones
    accepted (Cache.crop). An Engram layer's history rides on the cache object: it must follow the crop,
    or the next tokens hash n-grams with the rejected candidates and convolve their inputs."""
    ours, args, memory = _memlm_model(*CASES["engram_beside_memplus"])
    hf = MemlmForCausalLM.from_pretrained(str(_bundle(tmp_path, ours, args, memory))).eval()
    tokens = _tokens(2, 12, seed=8)
    with torch.no_grad():
        first = hf(tokens[:, :9], use_cache=True)  # 6 accepted positions, then 3 candidates
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        cache.crop(-3)  # the 3 candidates rejected (a negative count: transformers 5 and 4.x alike)
        resumed = hf(tokens[:, 6:], cache=cache).logits
        whole = hf(tokens, use_cache=False).logits[:, 6:]
    assert (resumed - whole).abs().max().item() <= TOL


def test_assisted_decoding_equals_greedy_decoding(tmp_path):
    ours, args, memory = _memlm_model(*CASES["engram_beside_memplus"])
    hf = MemlmForCausalLM.from_pretrained(str(_bundle(tmp_path / "main", ours, args, memory))).eval()
    helper_model, helper_args, helper_memory = _memlm_model(*CASES["engram_alone"], seed=1)
    helper = MemlmForCausalLM.from_pretrained(
        str(_bundle(tmp_path / "helper", helper_model, helper_args, helper_memory))).eval()
    prompt = _tokens(1, 5, seed=9)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(hf.generate(prompt, assistant_model=helper, **kw), hf.generate(prompt, **kw))


@pytest.mark.parametrize("case", ["memplus_shared_swilu", "engram_beside_memplus"])
def test_generate_with_kv_cache_matches_memlm_greedy(tmp_path, case):
    ours, args, memory = _memlm_model(*CASES[case])
    hf = MemlmForCausalLM.from_pretrained(str(_bundle(tmp_path, ours, args, memory))).eval()
    prompt = _tokens(2, 5, seed=3)
    with torch.no_grad():  # the cache generate() carries: filled by the prompt, then one position per step
        first = hf(prompt, use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values  # transformers 5 / 4
        assert cache.get_seq_length() == 5
        step = hf(prompt[:, :1], cache=cache).logits[:, -1]
        assert (step - ours(torch.cat([prompt, prompt[:, :1]], 1))[:, -1]).abs().max().item() <= TOL
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)
    expected = prompt  # memlm's greedy decoding, full recompute each step
    with torch.no_grad():
        for _ in range(12):
            expected = torch.cat([expected, ours(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, expected)


def test_beam_search_with_the_kv_cache_equals_beam_search_without(tmp_path):
    """Beam search reorders the cache's rows each step; an Engram layer's history (its n-grams' ids and
    conv inputs) must follow them, or a beam hashes another beam's tokens: the cached search then picks
    other tokens than the search that recomputes every sequence whole (use_cache=False)."""
    ours, args, memory = _memlm_model(*CASES["engram_beside_memplus"])
    hf = MemlmForCausalLM.from_pretrained(str(_bundle(tmp_path, ours, args, memory))).eval()
    prompt = _tokens(2, 5, seed=6)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, num_beams=4,
              num_return_sequences=4, pad_token_id=0)
    cached, whole = hf.generate(prompt, use_cache=True, **kw), hf.generate(prompt, use_cache=False, **kw)
    assert cached.shape == (8, 15) and torch.equal(cached, whole)


@pytest.mark.parametrize("case", ["memplus_shared_swilu", "engram_beside_memplus"])
def test_left_padded_batch_equals_unpadded_rows(tmp_path, case):
    ours, args, memory = _memlm_model(*CASES[case])
    hf = MemlmForCausalLM.from_pretrained(str(_bundle(tmp_path, ours, args, memory))).eval()
    short, long = _tokens(1, 6, seed=4), _tokens(1, 10, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask).logits
        assert torch.isfinite(padded).all()  # padding rows too (they see only themselves)
        assert (padded[0, 4:] - ours(short)[0]).abs().max().item() <= TOL
        assert (padded[1] - ours(long)[0]).abs().max().item() <= TOL


def test_every_config_field_and_ffn_kind_is_covered():
    model_fields, memory_fields = hf_remote.config_fields()
    model_known = set(hf_remote.MODEL_TO_CONFIG) | set(hf_remote.MODEL_TRAINING_ONLY)
    memory_mapped = set(hf_remote.MEMORY_INFERENCE) | set(hf_remote.MEMORY_LAYER_CHOICE)
    memory_known = memory_mapped | set(hf_remote.MEMORY_TRAINING_ONLY) | set(hf_remote.MEMORY_SECTIONS)
    assert model_fields <= model_known, (
        f"ModelArgs fields neither mapped nor training-only in hf/remote: {sorted(model_fields - model_known)}")
    assert memory_fields <= memory_known, (
        f"MemoryConfig fields neither mapped nor training-only in hf/remote: "
        f"{sorted(memory_fields - memory_known)}")
    # What the remote config is built from must exist.
    assert set(hf_remote.MODEL_TO_CONFIG) <= model_fields
    assert memory_mapped <= memory_fields
    remote = {f.kind for f in families() if f.remote_code}
    assert set(hf_remote.REMOTE_KINDS) == remote, "a family says remote_code and the modeling file disagrees"
    from memlm.hf.remote.configuration_memlm import FFN_KINDS, MEMORY_KEYS, MEMORY_SWITCHES

    assert set(FFN_KINDS) == set(hf_remote.REMOTE_KINDS)
    written = hf_remote.remote_config(ModelArgs(**ARGS), MemoryConfig(**CASES["memplus_shared_swilu"][1]))
    assert set(written["memory"]) == set(MEMORY_KEYS)
    # A switch (memory.w_bias) is written only when on: off, config.json is what it was before the switch.
    assert set(hf_remote.MEMORY_SWITCHES) == set(MEMORY_SWITCHES) <= set(hf_remote.MEMORY_INFERENCE)
    biased = hf_remote.remote_config(ModelArgs(**ARGS), MemoryConfig(**CASES["memplus_w_bias_sigmoid"][1]))
    assert set(biased["memory"]) == set(MEMORY_KEYS) | {"w_bias"} and biased["memory"]["w_bias"] is True


def test_modeling_files_import_only_torch_and_transformers():
    allowed = {"__future__", "contextlib", "math", "torch", "transformers"}
    for name in hf_remote.REMOTE_FILES:
        tree = ast.parse((hf_remote.SOURCE_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue  # relative imports stay inside the bundle
            assert roots <= allowed, f"{name} imports {sorted(roots - allowed)}"


# ------------------------------------------------ a real export, memlm absent
TRAINED = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "logging.wandb.mode=disabled", "steps=3",
           "optim.lr=3e-3"]
PKM_SMALL = ["memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16"]


def _trained_export(tmp: Path, overrides: list[str]):
    """A tiny run trained for 3 steps and exported by run/export.py: (the export, the trained model, tmp)."""
    from memlm.config.run import compose
    from memlm.run.export import export
    from memlm.train.trainer import Trainer

    trainer = Trainer(compose([*TRAINED, *overrides, f"dump_dir={tmp / 'run'}"]))
    trainer.fit()
    return export(tmp / "run", tmp / "export"), trainer.model.eval(), tmp


@pytest.fixture(scope="module")
def memplus_export(tmp_path_factory):
    """A trained tiny Memory+ run exported, and the trained model."""
    return _trained_export(tmp_path_factory.mktemp("remote_export"),
                           ["model.n_layers=3", "memory=memplus", "memory.layers=[1]", *PKM_SMALL])


@pytest.fixture(scope="module")
def ultramem_export(tmp_path_factory):
    """A trained tiny UltraMemV2 run (every block, implicit value expansion) exported, and the model."""
    return _trained_export(tmp_path_factory.mktemp("remote_ultramem"),
                           ["model.n_layers=2", "memory=ultramem", "memory.n_keys=8", "memory.knn=6",
                            "memory.k_dim=16", "memory.expansion=2"])


@pytest.fixture(scope="module")
def engram_export(tmp_path_factory):
    """A trained tiny run with Engram before blocks 0 and 2 and Memory+ in block 1, exported, and the model."""
    return _trained_export(tmp_path_factory.mktemp("remote_engram"),
                           ["model.n_layers=3", "memory=memplus", "memory.layers=[1]", *PKM_SMALL,
                            "memory.engram.layers=[0,2]", "memory.engram.heads=2", "memory.engram.head_dim=8",
                            "memory.value_lr=1e-1"])


@pytest.fixture(scope="module", params=["memplus", "ultramem", "engram"])
def exported(request):
    """Each real export: (its folder, the trained memlm model, the fixture's folder)."""
    return request.getfixturevalue(f"{request.param}_export")


def test_export_loads_with_auto_model_where_memlm_cannot_be_imported(exported):
    export_dir, ours, tmp = exported
    assert {"config.json", *hf_remote.REMOTE_FILES} <= {p.name for p in export_dir.iterdir()}
    run_remote_child(sys.executable, True, export_dir, ours, tmp)


def test_sharded_export_loads_in_transformers(memplus_export):
    from memlm.run.export import main

    export_dir, ours, tmp = memplus_export
    sharded = tmp / "sharded"
    assert main([str(tmp / "run"), str(sharded), "--max-shard-size", "20KB"]) == 0
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    hf = MemlmForCausalLM.from_pretrained(str(sharded)).eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() == 0.0


def test_export_loads_in_a_fresh_venv_without_memlm(exported):
    python = os.environ.get("MEMLM_REMOTE_PYTHON")
    if not python:
        pytest.skip("set MEMLM_REMOTE_PYTHON to the python of a venv with torch + transformers and no memlm "
                    "(make test-tf4 does; docs/checkpoints.md, 'Memory, MoE and PEER exports in transformers')")
    export_dir, ours, tmp = exported
    stdout = run_remote_child(python, False, export_dir, ours, tmp)
    assert "memlm installed: False" in stdout, stdout


def test_remote_row_dots_gradients_are_the_einsums():
    """The modeling file's row_dots takes memlm's forward (an aten dot per read); its own
    backward must be the gradient of table[idx] . x (fine-tuning an export in transformers)."""
    from memlm.hf.remote.layers_memlm import row_dots

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(10, 5, dtype=torch.double, generator=gen, requires_grad=True)
    x = torch.randn(7, 5, dtype=torch.double, generator=gen, requires_grad=True)
    idx = torch.randint(0, 10, (7, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda t, v: row_dots(t, idx, v), (table, x))
