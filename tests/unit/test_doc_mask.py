"""Document masking (model.doc_mask): the mask and positions, packed rows against
their documents run one by one, the two attention backends, the loader's
document ids, and a training run."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import compose_and_build

from memlm.config.run import compose
from memlm.data.loader import build_loader, document_ids
from memlm.errors import ConfigError
from memlm.model.doc_mask import doc_attention_mask, doc_positions
from memlm.train.data_source import model_batch
from memlm.train.loss import chunked_cross_entropy
from memlm.train.trainer import Trainer

EOS = 2
DOC = ["data=facts"]  # doc_mask needs a data kind with documents (not random)
MEMPLUS = ["model.n_layers=3", "memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4",
           "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2"]


def _documents(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Random documents of these lengths, each ending in EOS (as the packer stores them)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 512, (n,), generator=gen) for n in lengths]
    for d in docs:
        d[-1] = EOS
    return docs


def _packed(rows: list[list[int]]):
    """(tokens, doc_ids, docs per row): each row the concatenation of its documents."""
    docs = [_documents(lengths, seed) for seed, lengths in enumerate(rows)]
    tokens = torch.stack([torch.cat(d) for d in docs])
    return tokens, document_ids(tokens, EOS), docs


def test_mask_positions_and_document_ids_by_hand():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, 9], [EOS, 4, 4, 4, 4, 4]])
    doc_ids = document_ids(tokens, EOS)
    assert doc_ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]  # an EOS ends its own document
    assert doc_positions(doc_ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    mask = doc_attention_mask(doc_ids, "sdpa")
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)
    assert torch.equal(mask[1, 0, 1:, 1:], torch.ones(5, 5, dtype=torch.bool).tril())
    assert not mask[1, 0, 1:, 0].any()


@pytest.mark.parametrize("memory", ["dense", "memplus"])
def test_packed_logits_equal_documents_run_separately_with_rope_restart(memory):
    extra = MEMPLUS if memory == "memplus" else []
    model, _ = compose_and_build([*DOC, *extra, "model.doc_mask=true", "model.rope_restart=true"])
    model.eval()
    tokens, doc_ids, docs = _packed([[5, 9, 4, 6], [12, 1, 11]])  # 24 tokens per row
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids)
        causal = model(tokens)  # the same rows without the mask: documents see each other
        for row, row_docs in enumerate(docs):
            start = 0
            for doc in row_docs:
                alone = model(doc[None])[0]
                end = start + len(doc)
                torch.testing.assert_close(packed[row, start:end], alone, atol=1e-5, rtol=0)
                if start:  # the check can fail: without the mask, later documents differ
                    assert (causal[row, start:end] - alone).abs().max() > 1e-3
                start = end


def test_without_rope_restart_documents_keep_their_row_positions():
    """Without rope_restart a document keeps its absolute positions in the row:
    its logits are those of the document run alone at positions start.. (RoPE
    tables shifted by its offset). RoPE depends only on relative positions, so
    they also match the unshifted run up to float rounding of the rotation angles."""
    model, _ = compose_and_build([*DOC, "model.doc_mask=true"])
    model.eval()
    tokens, doc_ids, docs = _packed([[7, 10, 5]])
    cos, sin = model.rope_cos, model.rope_sin
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids)[0]
        start = 0
        for doc in docs[0]:
            end = start + len(doc)
            model.rope_cos, model.rope_sin = cos[start:], sin[start:]  # positions start, start+1, ...
            shifted = model(doc[None])[0]
            model.rope_cos, model.rope_sin = cos, sin
            torch.testing.assert_close(packed[start:end], shifted, atol=1e-5, rtol=0)
            torch.testing.assert_close(packed[start:end], model(doc[None])[0], atol=1e-4, rtol=0)
            start = end


@pytest.mark.parametrize("restart", [True, False])
def test_rope_restart_rotates_by_document_positions(restart):
    """The rotation every attention layer gets: positions from each document's
    start with rope_restart, the row's positions without. (Under the mask the two
    give the same logits up to rounding: RoPE scores depend on relative positions.)"""
    model, _ = compose_and_build([*DOC, "model.doc_mask=true", f"model.rope_restart={str(restart).lower()}"])
    tokens, doc_ids, _ = _packed([[5, 9, 4], [3, 8, 7]])
    seen = []
    model.layers[1].attention.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
    with torch.no_grad():
        model(tokens, doc_ids=doc_ids)
    positions = doc_positions(doc_ids) if restart else torch.arange(18).expand(2, 18)
    want = model.rope_cos[positions]  # (batch, seq, head_dim)
    assert torch.equal(seen[0].expand(2, 1, 18, -1)[:, 0], want)
    assert restart == (positions[0, 5].item() == 0)  # row 0: the second document starts at 5


def test_flex_block_mask_equals_sdpa_mask():
    """FlexAttention (the CUDA default) against the SDPA mask, on CPU without
    gradients (torch has no FlexAttention backward on CPU)."""
    model, _ = compose_and_build([*DOC, "model.doc_mask=true", "model.rope_restart=true"])
    model.eval()
    tokens, doc_ids, _ = _packed([[5, 9, 4, 6], [3, 8, 13]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        model.args.doc_mask_backend = "flex"
        flex = model(tokens, doc_ids=doc_ids)
        model.args.doc_mask_backend = "sdpa"
        sdpa = model(tokens, doc_ids=doc_ids)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


def test_block_mask_is_built_once_per_forward_and_shared_by_every_layer(monkeypatch):
    """One build per batch: the model builds the mask once in its forward and
    hands every layer the same object (not a build per layer)."""
    import memlm.model.doc_mask as doc_mask

    model, _ = compose_and_build([*DOC, "model.doc_mask=true", "model.doc_mask_backend=flex", "model.n_layers=3"])
    model.eval()
    tokens, doc_ids, _ = _packed([[5, 9, 4, 6], [3, 8, 13]])
    builds, seen = [], []
    build = doc_mask.same_doc_block_mask
    monkeypatch.setattr(doc_mask, "same_doc_block_mask", lambda ids: builds.append(build(ids)) or builds[-1])
    for block in model.layers:  # Attention(x, cos, sin, cache, layer_id, doc_mask), from Block
        block.attention.register_forward_pre_hook(lambda mod, args: seen.append(args[5]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        model(tokens, doc_ids=doc_ids)
        model(tokens, doc_ids=doc_ids)
    assert len(builds) == 2  # one per forward
    assert len(seen) == 6 and all(m is builds[0] for m in seen[:3]) and all(m is builds[1] for m in seen[3:])


def test_block_mask_builder_is_compiled_on_cuda():
    from memlm.model.doc_mask import _compiled_block_mask, block_mask_builder, same_doc_block_mask

    assert block_mask_builder(torch.device("cpu")) is same_doc_block_mask
    compiled = block_mask_builder(torch.device("cuda", 0))  # (only picks the builder: no GPU needed)
    assert compiled is _compiled_block_mask() and compiled is not same_doc_block_mask
    assert getattr(compiled, "_torchdynamo_orig_callable", None) is same_doc_block_mask


@pytest.mark.slow  # inductor's C++ compile of the builder: ~30 s on 2 cores
def test_compiled_block_mask_equals_eager_in_one_graph_without_recompiling():
    """The compiled builder (what CUDA runs; compiled for CPU here): one graph,
    no graph break, the eager builder's mask, and a second batch of the same
    shape reuses the graph."""
    from torch._dynamo.utils import counters

    from memlm.model.doc_mask import _compiled_block_mask, same_doc_block_mask

    compiled = _compiled_block_mask()
    torch._dynamo.reset()
    counters.clear()
    for rows in ([[100, 300, 112], [512]], [[7, 500, 5], [256, 256]]):
        _, doc_ids, _ = _packed(rows)
        with torch.no_grad():
            got, want = compiled(doc_ids), same_doc_block_mask(doc_ids)
        for a, b in zip(got.as_tuple(), want.as_tuple()):
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b or callable(a)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FlexAttention's "
                          "backward and the compiled kernel are CUDA-only); run on a GPU machine")


@CUDA
def test_cuda_flex_trains_like_sdpa():
    """On CUDA `auto` picks the compiled FlexAttention kernel: logits and gradients equal the SDPA mask's."""
    model, _ = compose_and_build([*DOC, "model.doc_mask=true", "model.rope_restart=true"])
    model = model.cuda()
    tokens, doc_ids, _ = _packed([[5, 9, 4, 6, 40, 200], [130, 1, 11, 100, 22]])
    tokens, doc_ids = tokens.cuda(), doc_ids.cuda()
    results = {}
    for backend in ("auto", "sdpa"):
        model.zero_grad(set_to_none=True)
        model.args.doc_mask_backend = backend
        logits = model(tokens, doc_ids=doc_ids)
        logits.float().square().mean().backward()
        results[backend] = (logits.detach(), model.layers[0].attention.wq.weight.grad.clone())
    mask = doc_attention_mask(doc_ids, "auto")
    assert type(mask).__name__ == "BlockMask"
    torch.testing.assert_close(results["auto"][0], results["sdpa"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results["auto"][1], results["sdpa"][1], atol=1e-4, rtol=1e-3)


def test_flex_backend_refuses_cpu_training():
    model, _ = compose_and_build([*DOC, "model.doc_mask=true", "model.doc_mask_backend=flex"])
    tokens, doc_ids, _ = _packed([[5, 9]])
    with pytest.raises(ConfigError, match="model.doc_mask_backend"):
        model(tokens, doc_ids=doc_ids)


def test_calls_without_document_ids_are_plain_causal():
    """Evaluation and KV-cache decoding pass no doc_ids: a doc_mask model is the plain model there."""
    masked, _ = compose_and_build([*DOC, "model.doc_mask=true", "model.rope_restart=true"])
    plain, _ = compose_and_build()
    tokens, doc_ids, _ = _packed([[6, 6]])
    with torch.no_grad():
        torch.testing.assert_close(masked(tokens), plain(tokens), atol=0, rtol=0)
        cache = masked.new_cache(1, 16)
        step_logits = torch.cat([masked(tokens[:, i:i + 1], cache=cache) for i in range(12)], dim=1)
        torch.testing.assert_close(step_logits, plain(tokens), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="no KV cache"):
            masked(tokens, masked.new_cache(1, 16), doc_ids=doc_ids)


def test_config_validation():
    with pytest.raises(ConfigError, match="model.rope_restart"):
        compose([*DOC, "model.rope_restart=true"])
    with pytest.raises(ConfigError, match="data.kind=random"):
        compose(["model.doc_mask=true"])
    with pytest.raises(ConfigError, match="model.doc_mask_backend"):
        compose([*DOC, "model.doc_mask=true", "model.doc_mask_backend=triton"])


def _facts(tmp_path, *extra):
    return compose([*DOC, "data.facts.entities=20", "data.facts.values=8", f"data.cache_dir={tmp_path / 'cache'}",
                    "data.seq_len=32", "data.micro_batch=4", "model.doc_mask=true", *extra])


def test_loader_document_ids_follow_the_stored_documents(tmp_path):
    cfg = _facts(tmp_path)
    with_ids = build_loader(cfg.data, doc_ids=True)
    plain = build_loader(cfg.data)
    # Every stored document ends in EOS and holds no other: EOS count == document count.
    source = with_ids.node.sources[0]
    assert sum(int((a == with_ids.eos_id).sum()) for a in source.arrays) == source.num_docs > 0
    for _ in range(3):
        inputs, targets, doc_ids = next(with_ids)
        ref_inputs, ref_targets = next(plain)
        assert torch.equal(inputs, ref_inputs) and torch.equal(targets, ref_targets)
        assert torch.equal(doc_ids, document_ids(inputs, with_ids.eos_id))
        assert doc_ids.max() > 0  # short documents: several per row
    assert with_ids.state_dict() == plain.state_dict()  # the state/resume contract is unchanged
    with pytest.raises(ConfigError, match="data.kind"):
        build_loader(compose().data, doc_ids=True)


def test_training_with_doc_mask_uses_the_loaders_document_ids(tmp_path):
    cfg = _facts(tmp_path, "model.rope_restart=true", "steps=3", "logging.wandb.mode=disabled",
                 "checkpoint.at_end=false", "val_batches=0", f"dump_dir={tmp_path / 'run'}")
    first = next(build_loader(cfg.data, doc_ids=True))
    trainer = Trainer(cfg)
    try:
        ref = copy.deepcopy(trainer.model)  # the initial weights
        with torch.no_grad():
            want = chunked_cross_entropy(ref(first[0], doc_ids=first[2]), first[1]).item()
            unmasked = chunked_cross_entropy(ref(first[0]), first[1]).item()
        losses = [trainer.train_step()["loss"] for _ in range(3)]
    finally:
        trainer.close()
    assert losses[0] == pytest.approx(want, abs=1e-5) and abs(want - unmasked) > 1e-4
    assert all(torch.isfinite(torch.tensor(losses)))


def _trainer_losses(overrides: list[str], batches, dump_dir) -> list[float]:
    trainer = Trainer(compose([*overrides, f"dump_dir={dump_dir}"]), train_loader=iter(batches))
    try:
        return [trainer.train_step()["loss"] for _ in range(len(batches))]
    finally:
        trainer.close()


WRAPPED = [*DOC, *MEMPLUS, "model.doc_mask=true", "model.rope_restart=true", "logging.wandb.mode=disabled",
           "checkpoint.at_end=false", "data.seq_len=24", "data.micro_batch=2", "optim.warmup=0"]


@pytest.mark.parametrize("wrap", [
    "parallel.activation_checkpoint=full",
    pytest.param("parallel.compile=true", marks=pytest.mark.slow),  # ~1 min of compilation on CPU
])
def test_doc_mask_trains_the_same_under_checkpointing_and_compile(tmp_path, wrap):
    """The mask and per-row RoPE tables pass through activation checkpointing (a memory
    block wraps its attention alone) and compiled blocks unchanged."""
    tokens, doc_ids, _ = _packed([[5, 9, 4, 6], [12, 1, 11]])
    batches = [(tokens, tokens.roll(-1, dims=1), doc_ids)] * 3
    eager = _trainer_losses(WRAPPED, batches, tmp_path / "eager")
    assert _trainer_losses([*WRAPPED, wrap], batches, tmp_path / "wrapped") == pytest.approx(eager, abs=1e-5)


@pytest.mark.slow
def test_doc_mask_two_fsdp_ranks_equal_one_process(tmp_path):
    """FSDP2 on 2 gloo ranks, each with its rows and their document ids, equals one process."""
    from distributed_workers import run_ranks
    from train_workers import train_on_slices

    tokens, doc_ids, _ = _packed([[5, 9, 4, 6], [12, 1, 11], [24], [2, 2, 20]])
    batches = [(tokens, tokens.roll(-1, dims=1), doc_ids)] * 2
    common = [o for o in WRAPPED if not o.startswith("data.micro_batch")]
    ref = _trainer_losses([*common, "data.micro_batch=4"], batches, tmp_path / "ref")
    torch.save(batches, tmp_path / "batches.pt")
    run_ranks(train_on_slices, 2, [*common, "data.micro_batch=2", f"dump_dir={tmp_path / 'dist'}"],
              str(tmp_path / "batches.pt"), len(batches), str(tmp_path / "dist.pt"), 2)
    got = torch.load(tmp_path / "dist.pt", weights_only=True)
    assert [m["loss"] for m in got["metrics"]] == pytest.approx(ref, rel=1e-5)


def test_trainer_batch_must_match_doc_mask():
    batch = (torch.zeros(1, 4, dtype=torch.long),) * 2
    with pytest.raises(ConfigError, match="doc_ids"):
        model_batch(batch, torch.device("cpu"), doc_mask=True)
    with pytest.raises(ConfigError, match="model.doc_mask"):
        model_batch((*batch, batch[0]), torch.device("cpu"), doc_mask=False)
