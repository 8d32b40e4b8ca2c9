"""init_from=hf:<dir>: a run starts from a tiny Llama saved by transformers.

The reference is transformers itself: the kept tensors must be bitwise the
HF model's, and the first training loss the HF model's loss on that batch."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from memlm.config.run import compose  # noqa: E402
from memlm.errors import ConfigError  # noqa: E402
from memlm.hf.mapping import from_hf_json, hf_names  # noqa: E402
from memlm.model.args import ModelArgs  # noqa: E402
from memlm.run.importer import check_hf_tokenizer  # noqa: E402
from memlm.train.preflight import check_init_from  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402


def composed(overrides):
    """compose + the check of init_from a run makes before it starts (memlm.train.preflight)."""
    cfg = compose(overrides)
    check_init_from(cfg)
    return cfg

VOCAB, SEQ = 128, 16
# name -> (LlamaConfig extras, save_pretrained kwargs, memlm overrides for the same architecture)
LLAMAS = {
    "untied": (dict(num_key_value_heads=2, tie_word_embeddings=False), {},
               ["model.n_kv_heads=2", "model.tie_embeddings=false"]),
    # saved in bf16, as released Llamas are: the fp32 run holds the same values
    "tied_sharded": (dict(num_key_value_heads=4, tie_word_embeddings=True), dict(max_shard_size="20KB"),
                     ["model.n_kv_heads=4", "model.tie_embeddings=true"]),
}
BF16 = {"tied_sharded"}
ARCH = ["model.vocab_size=128", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_hidden_dim=96",
        "model.rope_theta=20000.0", "model.norm_eps=1e-6"]
RUN = ["data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "optim.lr=1e-3",
       "logging.wandb.mode=disabled", "checkpoint.at_end=false"]
MEMORY = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4",
          "memory.k_dim=16", "memory.heads=2"]


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """name -> (directory, the LlamaForCausalLM that save_pretrained wrote there)."""
    out = {}
    for i, (name, (extra, save, _)) in enumerate(LLAMAS.items()):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rope_theta=20000.0, rms_norm_eps=1e-6, **extra,
        )
        torch.manual_seed(100 + i)
        model = transformers.LlamaForCausalLM(config).float().eval()
        with torch.no_grad():  # random norms: a swapped norm mapping cannot pass
            for key, p in model.named_parameters():
                if key.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        directory = tmp_path_factory.mktemp(name)
        if name in BF16:
            model = model.to(torch.bfloat16)
        model.save_pretrained(directory, **save)
        out[name] = (directory, model.float())  # the reference: the saved values, computed in fp32
    assert len(list(out["tied_sharded"][0].glob("model-*.safetensors"))) > 1  # really sharded
    from safetensors import safe_open

    for shard in out["tied_sharded"][0].glob("model-*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())
    return out


def _batches(n: int, seed: int = 0):
    tokens = torch.randint(0, VOCAB, (n, 2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens, [(t[:, :-1], t[:, 1:]) for t in tokens]


def _trainer(tmp_path, directory, overrides, batches=None):
    cfg = composed([*ARCH, *RUN, f"init_from=hf:{directory}", f"dump_dir={tmp_path}", *overrides])
    return Trainer(cfg, train_loader=iter(batches) if batches is not None else None)


def _hf_state(hf_model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in hf_model.state_dict().items()}


@pytest.mark.parametrize("name", list(LLAMAS))
def test_dense_import_is_bitwise_and_first_loss_is_the_hf_loss(tmp_path, llamas, name, capsys):
    directory, hf = llamas[name]
    tokens, batches = _batches(3)
    t = _trainer(tmp_path, directory, LLAMAS[name][2], batches)
    ours, theirs = t.model.state_dict(), _hf_state(hf)
    names = hf_names(t.cfg.model)
    assert set(names) == set(ours)  # every memlm tensor comes from the checkpoint
    for key, hf_key in names.items():
        assert ours[key].dtype == theirs[hf_key].dtype and torch.equal(ours[key], theirs[hf_key]), key
    with torch.no_grad():
        hf_loss = hf(input_ids=tokens[0], labels=tokens[0]).loss.item()
    losses = [t.train_step()["loss"] for _ in range(3)]
    t.close()
    assert losses[0] == pytest.approx(hf_loss, abs=1e-5)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(t.model.state_dict()["layers.0.attention.wq.weight"],
                           theirs["model.layers.0.self_attn.q_proj.weight"])
    assert f"initialized from {directory}: kept {len(names)} tensors, 0 new" in capsys.readouterr().out


def test_memory_layer_keeps_the_rest_bitwise_and_gets_fresh_memory(tmp_path, llamas, capsys):
    directory, hf = llamas["untied"]
    _, batches = _batches(3)
    t = _trainer(tmp_path / "a", directory, [*LLAMAS["untied"][2], *MEMORY], batches)
    ours, theirs = t.model.state_dict(), _hf_state(hf)
    kept = {k: v for k, v in hf_names(t.cfg.model).items() if k in ours}
    assert len(kept) == len(hf_names(t.cfg.model)) - 3  # block 1's MLP is gone
    assert not any(k.startswith("layers.1.feed_forward.w") for k in ours)
    for key, hf_key in kept.items():
        assert torch.equal(ours[key], theirs[hf_key]), key
    # New: exactly what a fresh run with the same seed initializes (the memory's own init).
    fresh = Trainer(composed([*ARCH, *RUN, *LLAMAS["untied"][2], *MEMORY, f"dump_dir={tmp_path / 'b'}"]),
                    train_loader=iter(batches))
    fresh_state = fresh.model.state_dict()
    fresh.close()
    new = [k for k in ours if k not in kept]
    assert new and all("memory" in k for k in new)
    for key in new:
        assert torch.equal(ours[key], fresh_state[key]), key
    out = capsys.readouterr().out
    assert f"kept {len(kept)} tensors, {len(new)} new (fresh init), 3 dropped" in out
    assert "model.layers.1.mlp.down_proj.weight, model.layers.1.mlp.gate_proj.weight" in out
    before = ours["shared.memory_values.weight"].clone()
    losses = [t.train_step()["loss"] for _ in range(3)]
    t.close()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(t.model.state_dict()["shared.memory_values.weight"], before)  # the memory trains


def test_parallel_placement_keeps_the_mlp_beside_the_memory(tmp_path, llamas):
    directory, hf = llamas["untied"]
    # With activation checkpointing too: the wrapped blocks' names are mapped back.
    t = _trainer(tmp_path, directory, [*LLAMAS["untied"][2], *MEMORY, "memory.placement=parallel",
                                       "parallel.activation_checkpoint=full"], _batches(1)[1])
    ours, theirs = t.model.state_dict(), _hf_state(hf)
    t.close()
    for w, hf_w in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        assert torch.equal(ours[f"layers.1.feed_forward.dense.{w}.weight"], theirs[f"model.layers.1.mlp.{hf_w}.weight"])


def test_run_from_the_command_line_path_starts_at_the_hf_loss(tmp_path, llamas):
    """The real loader (data.kind=random) and fit(): metrics.jsonl's first loss."""
    directory, hf = llamas["untied"]
    cfg = composed([*ARCH, *RUN, *LLAMAS["untied"][2], f"init_from=hf:{directory}", f"dump_dir={tmp_path / 'run'}",
                   "steps=2", "logging.every=1", "val_batches=0"])
    from memlm.distributed.env import DistEnv
    from memlm.train.data_source import build_train_loader

    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    inputs, targets = next(iter(build_train_loader(cfg, env)))
    tokens = torch.cat([inputs, targets[:, -1:]], dim=1)
    with torch.no_grad():
        hf_loss = hf(input_ids=tokens, labels=tokens).loss.item()
    Trainer(cfg).fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in lines if x.get("step") == 1 and "loss" in x)
    assert first["loss"] == pytest.approx(hf_loss, abs=1e-5)


def test_the_run_stays_loadable_without_the_hf_folder(tmp_path, llamas):
    """config.yaml keeps init_from=hf:<dir>; reading it back (load_model,
    export) must not need that folder any more."""
    from memlm.run.load import load_model

    directory = tmp_path / "llama"
    shutil.copytree(llamas["untied"][0], directory)
    cfg = composed([*ARCH, *RUN, *LLAMAS["untied"][2], f"init_from=hf:{directory}", f"dump_dir={tmp_path / 'run'}",
                   "steps=1", "checkpoint.at_end=true", "val_batches=0"])
    t = Trainer(cfg, train_loader=iter(_batches(1)[1]))
    t.fit()
    trained = {k: v.clone() for k, v in t.model.state_dict().items()}
    shutil.rmtree(directory)
    loaded = load_model(tmp_path / "run")
    assert loaded.config.init_from == f"hf:{directory}" and loaded.step == 1
    assert all(torch.equal(v, trained[k]) for k, v in loaded.model.state_dict().items())


def test_mismatched_config_names_every_difference_and_the_fix(llamas):
    directory, _ = llamas["untied"]
    with pytest.raises(ConfigError) as err:
        composed([*ARCH, *RUN, "model.dim=32", "model.n_layers=3", "model.n_kv_heads=1",
                 "model.rope_theta=10000.0", "model.tie_embeddings=true",
                 f"init_from=hf:{directory}"])
    msg = str(err.value)
    assert "model.dim=32 but hidden_size=64" in msg
    assert "model.n_layers=3 but num_hidden_layers=2" in msg
    assert "model.n_kv_heads=1 but num_key_value_heads=2" in msg
    assert "model.rope_theta=10000.0 but rope_theta=20000.0" in msg
    assert "model.tie_embeddings=true but tie_word_embeddings=false" in msg
    fix = "model.dim=64 model.n_layers=2 model.n_kv_heads=2 model.rope_theta=20000.0 model.tie_embeddings=false"
    assert msg.endswith(fix)
    composed([*ARCH, *RUN, *fix.split(), f"init_from=hf:{directory}"])  # the printed fix is a valid config
    assert "ffn_hidden_dim" not in msg  # only what differs


def test_bad_sources_fail_before_the_run_with_the_reason(tmp_path, llamas):
    directory, _ = llamas["untied"]
    run = [*ARCH, *RUN, *LLAMAS["untied"][2]]
    with pytest.raises(ConfigError, match=r"init_from='hf:/no/such'.*/no/such is not a directory"):
        composed([*run, "init_from=hf:/no/such"])
    with pytest.raises(ConfigError, match=r"init_from='hf:'.*hf:<dir>"):
        composed([*run, "init_from=hf:"])
    other = tmp_path / "gpt2"
    shutil.copytree(directory, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"model_type='gpt2', memlm imports model_type='llama' only"):
        composed([*run, f"init_from=hf:{other}"])
    (other / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"hidden_act='gelu' is not supported"):
        composed([*run, f"init_from=hf:{other}"])
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json is not a safetensors index"):
        composed([*run, f"init_from=hf:{other}"])
    (other / "model.safetensors.index.json").unlink()
    (other / "model.safetensors").rename(other / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"neither model.safetensors nor .*pytorch_model.bin.*safetensors only"):
        composed([*run, f"init_from=hf:{other}"])
    (other / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config.json does not exist"):
        composed([*run, f"init_from=hf:{other}"])
    with pytest.raises(ConfigError, match=r"model.ffn='moe'.*dense with init_from"):
        composed([*run, "model.ffn=moe", f"init_from=hf:{directory}"])


def test_missing_shard_names_the_file(tmp_path, llamas):
    directory, _ = llamas["tied_sharded"]
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"weight file .*{shard.name} is missing"):
        composed([*ARCH, *RUN, *LLAMAS["tied_sharded"][2], f"init_from=hf:{copy}"])


def test_config_json_of_transformers_4_and_5_read_alike():
    v5 = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 96, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": False}
    v4 = {**{k: v for k, v in v5.items() if k != "rope_parameters"}, "rope_theta": 500000.0, "rope_scaling": None}
    assert from_hf_json(v5) == from_hf_json(v4)
    assert from_hf_json(v5).rope_theta == 500000.0 and from_hf_json(v5).kv_heads == 2
    assert from_hf_json({k: v for k, v in v4.items() if k != "num_key_value_heads"}).kv_heads == 4
    with pytest.raises(KeyError, match="hidden_size"):
        from_hf_json({"model_type": "llama"})
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        from_hf_json({**v5, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}})


def test_tokenizer_must_be_the_checkpoints_sentencepiece_model(tmp_path, llamas):
    from memlm.data.tokenizer import Tokenizer, train_tokenizer

    docs = [f"document {i}: the quick brown fox {i * 7} jumps" for i in range(200)]
    ours = train_tokenizer(docs, str(tmp_path / "ours.model"), vocab_size=320)
    other = train_tokenizer(docs[:50] + ["other words entirely"] * 20, str(tmp_path / "other.model"), vocab_size=310)
    directory = tmp_path / "llama"
    shutil.copytree(llamas["untied"][0], directory)
    init_from = f"hf:{directory}"
    assert ("WARNING" in check_hf_tokenizer(init_from, ours)
            and "tokenizer.json alone" in check_hf_tokenizer(init_from, ours))
    shutil.copyfile(tmp_path / "ours.model", directory / "tokenizer.model")
    assert "is the checkpoint's tokenizer.model" in check_hf_tokenizer(
        init_from, Tokenizer(str(tmp_path / "ours.model")))
    with pytest.raises(ConfigError,
                       match=r"data.tokenizer=.*other.model.*tokenizer.model \(sha256 .*set data.tokenizer="):
        check_hf_tokenizer(init_from, other)
    assert "no tokenizer" in check_hf_tokenizer(init_from, None)


def test_model_args_round_trip_of_the_checked_fields():
    """Every compared field reads back from config.json: a field the check
    misses would let a differing checkpoint load."""
    args = ModelArgs(dim=48, n_layers=3, n_heads=6, n_kv_heads=3, vocab_size=77, ffn_hidden_dim=40,
                     rope_theta=1234.0, norm_eps=1e-4, tie_embeddings=True)
    from memlm.hf.mapping import to_hf_config

    back = from_hf_json(to_hf_config(args).to_dict())
    for key in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "hidden_dim", "rope_theta", "norm_eps",
                "tie_embeddings"):
        assert getattr(back, key) == getattr(args, key), key


@pytest.mark.slow
@pytest.mark.parametrize("init,memory", [("full", True), ("sharded", False)])
def test_two_fsdp_ranks_load_the_same_weights_and_loss(tmp_path, llamas, init, memory):
    """2 gloo ranks: FSDP2 shards the dense weights (parallel.init=sharded: built
    on meta), or the value table is split over memory_parallel=2; the import
    distributes the full tensors to the shards."""
    from distributed_workers import run_ranks
    from hf_import_workers import import_and_step

    directory, hf = llamas["untied"]
    tokens = torch.randint(0, VOCAB, (1, 4, SEQ + 1), generator=torch.Generator().manual_seed(3))
    torch.save([(t[:, :-1], t[:, 1:]) for t in tokens], tmp_path / "batches.pt")
    extra = [*LLAMAS["untied"][2], *([*MEMORY, "parallel.memory_parallel=2"] if memory else [])]
    overrides = [*ARCH, *RUN, *extra, f"parallel.init={init}", f"init_from=hf:{directory}",
                 f"dump_dir={tmp_path / 'run'}"]
    run_ranks(import_and_step, 2, overrides, str(tmp_path / "batches.pt"), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    theirs = _hf_state(hf)
    names = {k: v for k, v in hf_names(composed([*ARCH, *LLAMAS["untied"][2]]).model).items() if k in out["state"]}
    assert len(names) == (18 if memory else 21)
    for key, hf_key in names.items():
        assert torch.equal(out["state"][key], theirs[hf_key]), key
    if memory:  # fresh memory weights: the reference is one process from the same seed
        single = _trainer(tmp_path / "one", directory, [*extra, "parallel.memory_parallel=1", "data.micro_batch=4"],
                          [(tokens[0][:, :-1], tokens[0][:, 1:])])
        ref = single.train_step()["loss"]
        single.close()
    else:
        with torch.no_grad():
            ref = hf(input_ids=tokens[0], labels=tokens[0]).loss.item()
    assert out["loss"] == pytest.approx(ref, abs=1e-5)


def test_retrofit_a_parallel_memory_into_a_llama_then_teach_it_and_export_it(tmp_path, llamas):
    """The retrofit (docs/finetuning.md): a memory layer beside a transformers-made Llama's MLP with
    its values at zero adds nothing, so the first loss is the Llama's; finetune=memory then trains
    the values alone, and the export loads in plain transformers (trust_remote_code) with memlm's logits."""
    from hf_remote_child import run_remote_child

    from memlm.run.export import export

    directory, hf = llamas["untied"]
    tokens, batches = _batches(4)
    run = tmp_path / "run"
    t = _trainer(run, directory, [*LLAMAS["untied"][2], *MEMORY, "memory.placement=parallel",
                                  "memory.value_init_scale=0", "finetune=memory", "memory.value_lr=1e-2", "steps=4",
                                  "checkpoint.at_end=true", "val_batches=0"], batches)
    first = t.train_step()
    with torch.no_grad():
        hf_loss = hf(input_ids=tokens[0], labels=tokens[0]).loss.item()
    assert first["loss"] == pytest.approx(hf_loss, abs=1e-5)
    t.fit()
    ours, theirs = t.model.state_dict(), _hf_state(hf)
    names = hf_names(t.cfg.model)
    kept = [k for k in ours if k.replace(".dense.", ".") in names]
    assert len(kept) == len(theirs)  # every Llama tensor, the MLP beside the memory included
    for key in kept:  # frozen: bitwise the Llama's after training
        assert torch.equal(ours[key], theirs[names[key.replace(".dense.", ".")]]), key
    assert ours["shared.memory_values.weight"].abs().sum() > 0  # the values learned from zero
    run_remote_child(sys.executable, True, export(run, tmp_path / "export"), t.model.eval(), tmp_path)
