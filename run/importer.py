"""Start a run from weights outside memlm's checkpoints: a Hugging Face Llama, or a memlm export.

    python -m memlm.train init_from=hf:/models/llama model.dim=2048 ... memory=memplus memory.layers=[8]
    python -m memlm.train init_from=exports/try1 <the export's model and memory config> data=...

What `init_from` names is read from the folder's files (memlm.run.source):

- a memlm export (`python -m memlm.hf.export`: `memlm_config.json` and
  safetensors), named with or without `hf:`: the run's model and memory config
  must describe the export's model (`check_export_source`, the values in
  `architecture`), and every tensor is loaded, bitwise. A dense export is
  also a Llama (HF names, `config.json`): named with `hf:` it is imported as
  one (below), so memory layers can be added to it;
- `hf:<dir>`, what `LlamaForCausalLM.save_pretrained` writes: `config.json`
  (model_type llama) and `model.safetensors`, or the shards listed in
  `model.safetensors.index.json`;
- any other `<dir>`: a memlm checkpoint (weights only, checkpoint/checkpointer.py).

The run's model config must describe the same architecture: `check_import_source`
(called by memlm.train.preflight before anything starts) names every difference with
both values and prints the overrides that fix it. The model config is not
derived silently: the run's config.yaml is then what ran, and a preset cannot
quietly hide a changed width.

Which tensors come from a Llama (docs/checkpoints.md, "Starting from a
Hugging Face Llama"):

- kept, bitwise: token embeddings, output head, final norm, every block's
  attention projections and both norms, the MLP of every dense block, and the
  MLP of a memory block with `memory.placement=parallel` (its `dense` SwiGLU);
- new, initialized as in any fresh run: the memory layer's weights (queries,
  keys, value table, gates) or the moe/peer weights of the blocks in
  `memory.layers`;
- dropped: the MLP of a block whose FFN is replaced (`placement=replace`).

The Trainer calls `import_init(cfg, model, tokenizer, print_fn)` in place of a
checkpoint load; the optimizer and schedule start fresh, as with any init_from.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from memlm.errors import ConfigError
from memlm.hf.mapping import from_hf_json, from_hf_state_dict
from memlm.hf.pretrained import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    ExportError,
    open_safetensors,
    read_config,
    weight_files,
)
from memlm.hf.remote import MEMORY_INFERENCE, memory_settings
from memlm.memory.config import MemoryConfig
from memlm.model.args import ModelArgs
from memlm.model.family import family_of
from memlm.model.lora import is_lora_key
from memlm.model.transformer import layer_ffn_kinds
from memlm.run.source import ModelSource, strip_prefix

if TYPE_CHECKING:
    from memlm.config.run import Config

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
# Memory settings a run may change from its export's: lookup widths, no tensors.
FREE_MEMORY = ("memory.knn", "memory.eval_knn")


def _fail(init_from: str, what: str) -> ConfigError:
    return ConfigError("init_from", init_from, f"hf:<dir> with a Hugging Face Llama checkpoint "
                       f"(LlamaForCausalLM.save_pretrained: config.json + safetensors) or a memlm export "
                       f"({CONFIG_NAME}); {what}")


def read_hf_args(init_from: str) -> ModelArgs:
    """The architecture in `<dir>/config.json`, after checking the folder holds a
    Llama checkpoint memlm can read (ConfigError naming what is wrong)."""
    directory = strip_prefix(init_from)
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
    except ExportError as err:  # a weight file missing, or an index that is not one
        raise _fail(init_from, str(err)) from None
    try:
        return from_hf_json(values)
    except (KeyError, ValueError) as err:
        raise _fail(init_from, f"{config_path}: {err.args[0] if err.args else err}") from None


def _show(value: Any) -> str:
    """A value as a Hydra override spells it."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_hf_source(cfg: Config) -> ModelArgs:
    """For `init_from=hf:<dir>`: the folder is a readable Llama checkpoint and the
    run's model config has its architecture (every difference is named)."""
    hf = read_hf_args(cfg.init_from)
    if not family_of(cfg.model.ffn).llama_equivalent:
        raise ConfigError("model.ffn", cfg.model.ffn, f"dense with init_from={cfg.init_from} (the Llama's MLPs "
                          "fill the dense blocks; other kinds go into the memory.layers blocks via memory.kind)")
    diffs = [(key, get(cfg.model), get(hf), hf_key) for key, get, hf_key in _ARCH if get(cfg.model) != get(hf)]
    if diffs:
        listed = "; ".join(f"model.{key}={_show(ours)} but {hf_key}={_show(theirs)}"
                           for key, ours, theirs, hf_key in diffs)
        fix = " ".join(f"model.{key}={_show(theirs)}" for key, _, theirs, _ in diffs)
        raise ConfigError(
            "init_from", cfg.init_from,
            f"a Llama with the run's architecture; {strip_prefix(cfg.init_from) / HF_CONFIG} differs in "
            f"{len(diffs)} value(s): {listed}. Run with the checkpoint's values: {fix}",
        )
    return hf


def check_hf_tokenizer(init_from: str, tokenizer: Any) -> str:
    """The run's tokenizer (a memlm Tokenizer or None) must be the checkpoint's
    sentencepiece `tokenizer.model`: token ids mean what the model learned.
    Returns a line for the log; raises ConfigError naming both files."""
    hf_tok = strip_prefix(init_from) / HF_TOKENIZER
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


def _plan(init_from: str, args: ModelArgs, target: dict[str, Any], layout: str) -> tuple[dict[str, str], list[str]]:
    """File name -> memlm name of every tensor to load, and the file names dropped.
    `layout`: "hf_llama" (Llama names) or "memlm" (an export's own names). Reads only the safetensors headers."""
    hf_keys: set[str] = set()
    for path in weight_files(strip_prefix(init_from)):
        with open_safetensors(path) as fh:
            hf_keys.update(fh.keys())
    if layout == "memlm":
        ours = {k: k for k in hf_keys}
    else:
        try:  # the mapping checks the names alone: values are not needed
            ours = from_hf_state_dict({k: k for k in hf_keys}, args)  # memlm name -> HF name
        except KeyError as err:
            raise ConfigError("init_from", init_from, f"a Llama checkpoint matching its config.json; "
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
def load_safetensors(init_from: str, model: torch.nn.Module, args: ModelArgs, layout: str = "hf_llama",
                     exact: bool = False) -> dict[str, list[str]]:
    """Copy the tensors of the folder `init_from` names into `model` (plain, FSDP-sharded or
    memory-parallel: DCP's full-state-dict load distributes them), one
    safetensors file at a time: a rank holds at most one file's tensors.
    `exact`: every tensor of the model must be in the files and every file's tensor in the model
    (an export), checked before anything is read.

    Returns {"kept": memlm names, "new": memlm names left as initialized,
    "dropped": file names with no place in this model (never read)}."""
    # references, no copies; DTensors keep the global shape. LoRA adapters (finetune=lora) start fresh.
    target = {k: v for k, v in get_model_state_dict(model).items() if not is_lora_key(k)}
    plan, dropped = _plan(init_from, args, target, layout)
    kept = set(plan.values())
    new = [k for k in target if k not in kept]
    if exact and (new or dropped):
        raise ConfigError("init_from", init_from, f"an export holding every tensor of the run's model; "
                          f"missing {new[:5]}, not in the model {dropped[:5]}")
    for path in weight_files(strip_prefix(init_from)):
        part: dict[str, torch.Tensor] = {}
        with open_safetensors(path) as fh:
            for hf_key in fh.keys():
                dest = plan.get(hf_key)
                if dest is None:
                    continue  # dropped, a tied lm_head alias, or rotary inv_freq
                value = fh.get_tensor(hf_key)
                if tuple(value.shape) != tuple(target[dest].shape):
                    raise ConfigError(
                        "init_from", init_from, f"tensors shaped as in its config; {hf_key} "
                        f"in {path.name} is {tuple(value.shape)}, memlm's {dest} is {tuple(target[dest].shape)}")
                part[dest] = value
        if part:
            set_model_state_dict(model, part, options=StateDictOptions(full_state_dict=True, strict=False))
    return {"kept": sorted(kept), "new": new, "dropped": dropped}


def import_hf(cfg: Config, model: torch.nn.Module, tokenizer: Any, log: Callable[[str], None]) -> dict[str, list[str]]:
    """init_from=hf:<dir> (checked by check_import_source): load, and log what was kept, new and dropped."""
    directory = strip_prefix(cfg.init_from)
    log(f"[hf-import] {check_hf_tokenizer(cfg.init_from, tokenizer)}")
    summary = load_safetensors(cfg.init_from, model, cfg.model)
    log(f"[hf-import] initialized from {directory}: kept {len(summary['kept'])} tensors, "
        f"{len(summary['new'])} new (fresh init), {len(summary['dropped'])} dropped")
    if summary["new"]:
        log(f"[hf-import]   new: {', '.join(summary['new'])}")
    if summary["dropped"]:
        log(f"[hf-import]   dropped (MLPs of blocks replaced by memory.kind={cfg.memory.kind}): "
            f"{', '.join(summary['dropped'])}")
    return summary


# ------------------------------------------------------------------ exports
def _export_fail(init_from: str, what: str) -> ConfigError:
    return ConfigError("init_from", init_from, f"a memlm export (python -m memlm.hf.export: {CONFIG_NAME} "
                       f"+ safetensors), a memlm checkpoint, or hf:<dir> with a Hugging Face Llama; {what}")


def read_export(init_from: str) -> tuple[ModelArgs, MemoryConfig, dict[str, Any]]:
    """The model and memory config of an export (memlm.hf.pretrained.read_config), after checking
    its weight files are there (ConfigError naming what is wrong)."""
    directory = strip_prefix(init_from)
    try:
        args, memory, meta = read_config(directory)
        weight_files(directory)
    except ExportError as err:  # a file missing, not JSON, or not an export's config (memlm.hf.pretrained)
        raise _export_fail(init_from, str(err)) from None
    return args, memory, meta


def _built_memory(args: ModelArgs, memory: MemoryConfig) -> MemoryConfig:
    """The MemoryConfig the model's non-dense blocks are built with: `memory`, or with memory.kind=none
    and model.ffn=moe|peer|..., that kind's defaults (as the FFN builders and the export do)."""
    if memory.kind == "none" and not family_of(args.ffn).llama_equivalent:
        return MemoryConfig(kind=args.ffn)
    return memory


def architecture(args: ModelArgs, memory: MemoryConfig) -> dict[str, Any]:
    """What decides a model's tensors and its forward math, keyed by the override that sets it, with
    resolved values (n_kv_heads 0 -> n_heads, the SwiGLU size, memory.layers from spread, v_dim,
    expert_hidden_dim); memory settings only for a model with non-dense blocks. Not in it:
    model.max_seq_len (RoPE is computed) and the training-only settings (hf/remote:
    MODEL_TRAINING_ONLY, MEMORY_TRAINING_ONLY)."""
    values: dict[str, Any] = {f"model.{key}": get(args) for key, get, _ in _ARCH}  # what a Llama's check reads
    values.update({"model.ffn": args.ffn, "memory.kind": memory.kind,
                   "memory.layers": memory.resolved_layers(args.n_layers)})
    built = _built_memory(args, memory)
    if not all(family_of(kind).llama_equivalent for kind in layer_ffn_kinds(args, built)):
        values.update(_memory_settings(args, built))
    return values


def _memory_settings(args: ModelArgs, memory: MemoryConfig) -> dict[str, Any]:
    """memory.<key> -> value of every memory setting the model computes with, resolved as the remote
    config resolves them (v_dim 0 -> model.dim, expert_hidden_dim 0 -> dense size // top_k)."""
    settings = memory_settings(args, memory)  # UltraMemV2's keys only for a model that holds it
    return {f"memory.{key}": settings[key] for key in MEMORY_INFERENCE if key in settings}


def check_export_source(cfg: Config) -> tuple[ModelArgs, MemoryConfig, dict[str, Any]]:
    """For `init_from=<export>`: the folder is a readable export and the run's model and memory
    config build its model. A difference is refused with every difference named and the overrides
    that fix them all; memory.knn / eval_knn (FREE_MEMORY: no tensors) alone are not refused."""
    args, memory, meta = read_export(cfg.init_from)
    ours, theirs = architecture(cfg.model, cfg.memory), architecture(args, memory)
    # A run without the export's memory blocks: its own memory settings, resolved alike.
    mine = {**_memory_settings(cfg.model, cfg.memory), **ours}
    diffs = [(key, mine[key], value) for key, value in theirs.items() if mine[key] != value]
    if any(key not in FREE_MEMORY for key, _, _ in diffs):
        listed = "; ".join(f"{key}={_show(run)} but the export's is {_show(its)}" for key, run, its in diffs)
        fix = " ".join(f"{key}={_show(its)}" for key, _, its in diffs)
        hint = ""
        if meta.get("weights_layout") == "hf_llama":  # named without hf: (with it, a Llama import)
            hint = (f" (or init_from=hf:{strip_prefix(cfg.init_from)}: a dense export is also a Llama, which "
                    "takes new memory layers)")
        raise ConfigError(
            "init_from", cfg.init_from,
            f"an export of the run's model; {strip_prefix(cfg.init_from) / CONFIG_NAME} differs in {len(diffs)} "
            f"value(s): {listed}. Run with the export's values: {fix}{hint}",
        )
    return args, memory, meta


def import_export(cfg: Config, meta: dict[str, Any], model: torch.nn.Module, tokenizer: Any,
                  log: Callable[[str], None]) -> dict[str, list[str]]:
    """init_from=<export> (checked by check_import_source; `meta`: its memlm_config.json): load every
    tensor (exact: none new, none dropped) and log it."""
    log(f"[init] {check_hf_tokenizer(cfg.init_from, tokenizer)}")
    summary = load_safetensors(cfg.init_from, model, cfg.model, meta.get("weights_layout", "memlm"), exact=True)
    log(f"[init] initialized from the export {strip_prefix(cfg.init_from)} (step {meta.get('step')}): "
        f"all {len(summary['kept'])} tensors")
    return summary


def check_import_source(cfg: Config, source: ModelSource) -> ModelSource:
    """What the preflight checks of an `init_from` export or Llama (`source`, as model_source named it)
    before a run starts: its architecture against the run's. Returns `source` with what was read
    (`checked`), which import_init loads from without reading it again."""
    if source.kind == "hf":
        return dataclasses.replace(source, checked=check_hf_source(cfg))
    if source.kind == "export":
        return dataclasses.replace(source, checked=check_export_source(cfg))
    raise ValueError(f"check_import_source: {source.name} is a memlm checkpoint, not an export or a Llama")


def import_init(cfg: Config, source: ModelSource, model: torch.nn.Module, tokenizer: Any,
                log: Callable[[str], None]) -> dict[str, list[str]]:
    """The load of an `init_from` that is not a memlm checkpoint: a Llama or an export, as
    check_import_source returned it."""
    if source.checked is None:
        raise ValueError(f"import_init: {source.name} was not checked (check_import_source)")
    if source.kind == "export":
        return import_export(cfg, source.checked[2], model, tokenizer, log)
    return import_hf(cfg, model, tokenizer, log)
