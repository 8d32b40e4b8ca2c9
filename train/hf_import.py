"""Start a run from a Hugging Face Llama checkpoint: `init_from=hf:<dir>`.

    python -m memlm.train init_from=hf:/models/llama model.dim=2048 ... memory=memplus memory.layers=[8]

`<dir>` is what `LlamaForCausalLM.save_pretrained` writes: `config.json`
(model_type llama) and `model.safetensors`, or the shards listed in
`model.safetensors.index.json`. The run's model config must describe the same
architecture: `check_hf_source` (called by `compose`, before anything starts)
names every difference with both values and prints the overrides that fix it.
The model config is not derived silently: the run's config.yaml is then what
ran, and a preset cannot quietly hide a changed width.

Which tensors come from the checkpoint (docs/checkpoints.md, "Starting from a
Hugging Face Llama"):

- kept, bitwise: token embeddings, output head, final norm, every block's
  attention projections and both norms, the MLP of every dense block, and the
  MLP of a memory block with `memory.placement=parallel` (its `dense` SwiGLU);
- new, initialized as in any fresh run: the memory layer's weights (queries,
  keys, value table, gates) or the moe/peer weights of the blocks in
  `memory.layers`;
- dropped: the MLP of a block whose FFN is replaced (`placement=replace`).

The Trainer calls `import_hf(cfg, model, tokenizer, print_fn)` in place of a
checkpoint load; the optimizer and schedule start fresh, as with any init_from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from memlm.errors import ConfigError
from memlm.model.args import ModelArgs
from memlm.model.hf import from_hf_json, from_hf_state_dict
from memlm.model.pretrained import INDEX_NAME, WEIGHTS_NAME, weight_files

HF_PREFIX = "hf:"
HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.model"  # sentencepiece: the only tokenizer format memlm reads

# (memlm key, its value as the model resolves it, config.json key)
_ARCH: tuple[tuple[str, Callable[[ModelArgs], Any], str], ...] = (
    ("dim", lambda a: a.dim, "hidden_size"),
    ("n_layers", lambda a: a.n_layers, "num_hidden_layers"),
    ("n_heads", lambda a: a.n_heads, "num_attention_heads"),
    ("n_kv_heads", lambda a: a.kv_heads, "num_key_value_heads"),
    ("vocab_size", lambda a: a.vocab_size, "vocab_size"),
    ("ffn_hidden_dim", lambda a: a.hidden_dim, "intermediate_size"),
    ("rope_theta", lambda a: a.rope_theta, "rope_theta"),
    ("norm_eps", lambda a: a.norm_eps, "rms_norm_eps"),
    ("tie_embeddings", lambda a: a.tie_embeddings, "tie_word_embeddings"),
)
_MLP_KEY = re.compile(r"^(layers\.\d+\.feed_forward)\.(w[123]\.weight)$")


def hf_source(init_from: str) -> Path | None:
    """The checkpoint directory of `init_from=hf:<dir>`, or None for a memlm checkpoint."""
    return Path(init_from[len(HF_PREFIX):]) if init_from.startswith(HF_PREFIX) else None


def _fail(init_from: str, what: str) -> ConfigError:
    return ConfigError("init_from", init_from, f"hf:<dir> with a Hugging Face Llama checkpoint "
                       f"(LlamaForCausalLM.save_pretrained: config.json + safetensors); {what}")


def read_hf_args(init_from: str) -> ModelArgs:
    """The architecture in `<dir>/config.json`, after checking the folder holds a
    Llama checkpoint memlm can read (ConfigError naming what is wrong)."""
    directory = hf_source(init_from)
    assert directory is not None, init_from
    if not directory.is_dir():
        raise _fail(init_from, f"{directory} is not a directory")
    config_path = directory / HF_CONFIG
    if not config_path.is_file():
        raise _fail(init_from, f"{config_path} does not exist")
    try:
        values = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _fail(init_from, f"{config_path} is not valid JSON ({err})") from None
    if not isinstance(values, dict) or values.get("model_type") != "llama":
        model_type = values.get("model_type") if isinstance(values, dict) else None
        raise _fail(init_from, f"{config_path} has model_type={model_type!r}, memlm imports model_type='llama' only")
    if not (directory / WEIGHTS_NAME).is_file() and not (directory / INDEX_NAME).is_file():
        present = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        raise _fail(init_from, f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME} (weight files there: "
                    f"{present or 'none'}; memlm reads safetensors only: re-save with save_pretrained)")
    try:
        weight_files(directory)
    except FileNotFoundError as err:
        raise _fail(init_from, str(err)) from None
    except (ValueError, KeyError, TypeError) as err:  # a malformed index
        raise _fail(init_from, f"{directory / INDEX_NAME} is not a safetensors index with a weight_map ({err})") from None
    try:
        return from_hf_json(values)
    except (KeyError, ValueError) as err:
        raise _fail(init_from, f"{config_path}: {err.args[0] if err.args else err}") from None


def _show(value: Any) -> str:
    """A value as a Hydra override spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_hf_source(cfg: Any) -> ModelArgs:
    """For `init_from=hf:<dir>`: the folder is a readable Llama checkpoint and the
    run's model config has its architecture (every difference is named)."""
    hf = read_hf_args(cfg.init_from)
    if cfg.model.ffn != "dense":
        raise ConfigError("model.ffn", cfg.model.ffn, f"dense with init_from={cfg.init_from} (the Llama's MLPs "
                          "fill the dense blocks; other kinds go into the memory.layers blocks via memory.kind)")
    diffs = [(key, get(cfg.model), get(hf), hf_key) for key, get, hf_key in _ARCH if get(cfg.model) != get(hf)]
    if diffs:
        listed = "; ".join(f"model.{key}={_show(ours)} but {hf_key}={_show(theirs)}" for key, ours, theirs, hf_key in diffs)
        fix = " ".join(f"model.{key}={_show(theirs)}" for key, _, theirs, _ in diffs)
        raise ConfigError(
            "init_from", cfg.init_from,
            f"a Llama with the run's architecture; {hf_source(cfg.init_from) / HF_CONFIG} differs in "
            f"{len(diffs)} value(s): {listed}. Run with the checkpoint's values: {fix}",
        )
    return hf


def check_hf_tokenizer(init_from: str, tokenizer: Any) -> str:
    """The run's tokenizer (a memlm Tokenizer or None) must be the checkpoint's
    sentencepiece `tokenizer.model`: token ids mean what the model learned.
    Returns a line for the log; raises ConfigError naming both files."""
    hf_tok = hf_source(init_from) / HF_TOKENIZER
    if tokenizer is None:
        return "the run has no tokenizer (data.kind=random): token ids are used as they are"
    if not hf_tok.is_file():
        return (f"WARNING: {hf_tok.parent} ships no sentencepiece {HF_TOKENIZER} (a tokenizer.json alone is not "
                f"read by memlm): nothing checks that data.tokenizer={tokenizer.path} matches the model's ids")
    from memlm.data.tokenizer import Tokenizer

    theirs = Tokenizer(str(hf_tok))
    if theirs.sha256 != tokenizer.sha256:
        raise ConfigError(
            "data.tokenizer", tokenizer.path,
            f"the tokenizer of init_from={init_from}: {hf_tok} (sha256 {theirs.sha256[:16]}...), but the run "
            f"tokenizes with {tokenizer.path} (sha256 {tokenizer.sha256[:16]}...); set data.tokenizer={hf_tok} "
            "(and prepare shards with it)",
        )
    return f"tokenizer {tokenizer.path} is the checkpoint's {HF_TOKENIZER}"


def _plan(directory: Path, args: ModelArgs, target: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """HF name -> memlm name of every tensor to load, and the HF names dropped.
    Reads only the safetensors headers."""
    hf_keys: set[str] = set()
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as fh:
            hf_keys.update(fh.keys())
    try:  # the mapping checks the names alone: values are not needed
        ours = from_hf_state_dict({k: k for k in hf_keys}, args)  # memlm name -> HF name
    except KeyError as err:
        raise ConfigError("init_from", f"{HF_PREFIX}{directory}", f"a Llama checkpoint matching its config.json; "
                          f"{err.args[0]}") from None
    plan, dropped = {}, []
    for key, hf_key in ours.items():
        dest = key if key in target else _MLP_KEY.sub(r"\1.dense.\2", key)  # placement=parallel
        if dest in target:
            plan[hf_key] = dest
        else:
            dropped.append(hf_key)
    return plan, sorted(dropped)


@torch.no_grad()
def load_hf_weights(directory: Path, model: torch.nn.Module, args: ModelArgs) -> dict[str, list[str]]:
    """Copy the checkpoint's tensors into `model` (plain, FSDP-sharded or
    memory-parallel: DCP's full-state-dict load distributes them), one
    safetensors file at a time: a rank holds at most one file's tensors.

    Returns {"kept": memlm names, "new": memlm names left as initialized,
    "dropped": HF names with no place in this model (never read)}."""
    target = get_model_state_dict(model)  # references, no copies; DTensors keep the global shape
    plan, dropped = _plan(directory, args, target)
    for path in weight_files(directory):
        part: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as fh:
            for hf_key in fh.keys():
                dest = plan.get(hf_key)
                if dest is None:
                    continue  # dropped, a tied lm_head alias, or rotary inv_freq
                value = fh.get_tensor(hf_key)
                if tuple(value.shape) != tuple(target[dest].shape):
                    raise ConfigError(
                        "init_from", f"{HF_PREFIX}{directory}", f"tensors shaped as in its config.json; {hf_key} "
                        f"in {path.name} is {tuple(value.shape)}, memlm's {dest} is {tuple(target[dest].shape)}")
                part[dest] = value
        if part:
            set_model_state_dict(model, part, options=StateDictOptions(full_state_dict=True, strict=False))
    kept = set(plan.values())
    return {"kept": sorted(kept), "new": [k for k in target if k not in kept], "dropped": dropped}


def import_hf(cfg: Any, model: torch.nn.Module, tokenizer: Any, log: Callable[[str], None]) -> dict[str, list[str]]:
    """init_from=hf:<dir>: check, load, and log what was kept, new and dropped."""
    check_hf_source(cfg)  # again: a Config built without compose() is checked too
    directory = hf_source(cfg.init_from)
    log(f"[hf-import] {check_hf_tokenizer(cfg.init_from, tokenizer)}")
    summary = load_hf_weights(directory, model, cfg.model)
    log(f"[hf-import] initialized from {directory}: kept {len(summary['kept'])} tensors, "
        f"{len(summary['new'])} new (fresh init), {len(summary['dropped'])} dropped")
    if summary["new"]:
        log(f"[hf-import]   new: {', '.join(summary['new'])}")
    if summary["dropped"]:
        log(f"[hf-import]   dropped (MLPs of blocks replaced by memory.kind={cfg.memory.kind}): "
            f"{', '.join(summary['dropped'])}")
    return summary
