"""Export a checkpoint to safetensors (+ the Hugging Face Llama layout for dense models).

    python -m memlm.hf.export runs/demo/checkpoints/step_00000300 exports/demo
    python -m memlm.hf.export runs/demo/checkpoints/latest exports/demo --max-shard-size 2GB

Writes `model.safetensors` (or shards + `model.safetensors.index.json` above
--max-shard-size), `memlm_config.json`, `generation_config.json`, and the
tokenizer when the run used one: the sentencepiece `tokenizer.model` plus
the Hugging Face `tokenizer.json` / `tokenizer_config.json` converted from it
(hf/bundle.py: `AutoTokenizer.from_pretrained(out_dir, trust_remote_code=False)`
gives memlm's ids, eos first). Dense models are written with Hugging Face Llama tensor names and a HF
`config.json`, so `transformers.LlamaForCausalLM.from_pretrained(out_dir)`
loads the same directory. Other models (memory, MoE, PEER layers) get a
`config.json` with `auto_map` and the modeling files of memlm/hf/remote/,
so `AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)`
loads them without memlm installed; every export loads with
`memlm.hf.from_pretrained(out_dir)` and starts a new run with
`python -m memlm.train init_from=out_dir ...` (run/importer.py).

A checkpoint holding a NaN or inf tensor is refused before anything is
written (ExportError naming the tensors; the command exits 1 with one line).

Every export writes `memlm_manifest.json` last: the size and crc32 of each of
its files, which every memlm load checks (hf/pretrained.py). Files follow the
umask.

What out_dir may be (checked before anything is read or written; a refusal
is one line, exit 2, and touches nothing):
- never the checkpoint, a folder inside it or one holding it (its run folder,
  `runs/`), nor any memlm run folder or a folder holding one;
- a new or empty folder: written;
- an earlier export of the same run (its memlm_config.json names the run):
  replaced; files you added to it (a model card, `.git/`) are kept, copied
  into the new export and named; a file the export wrote that you changed
  since (its crc32 is not the manifest's) is refused, naming it;
- an export of another run: refused unless --overwrite;
- with --overwrite, any memlm export that holds nothing but its own files
  (its manifest's): replaced whole; files you added are refused, naming them;
- anything else (a folder of yours, an export without a manifest): refused.

    python -m memlm.hf.export runs/demo exports/demo --overwrite

The export is written into a new folder beside out_dir and swapped in at the
end (memlm.files.atomic_output_dir): an export that fails or is killed midway
leaves the previous one whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import memlm
from memlm.checkpoint.checkpointer import Checkpointer, verify
from memlm.checkpoint.finite import check_finite
from memlm.config.run import from_yaml
from memlm.errors import MemlmError, entry_point
from memlm.files import (
    OutputError,
    atomic_output_dir,
    changed_files,
    check_output_path,
    follow_umask,
    foreign_files,
    listing,
)
from memlm.finetune.modes import mode_of
from memlm.hf.bundle import hf_token_ids, portable_config_json, write_hf_side_files
from memlm.hf.mapping import to_hf_config, to_hf_state_dict
from memlm.hf.pretrained import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    ExportError,
    read_manifest,
    write_manifest,
)
from memlm.hf.remote import write_remote_code
from memlm.model.family import family_of
from memlm.model.transformer import layer_ffn_kinds
from memlm.run.load import resolve_checkpoint_dir, run_tokenizer_path
from memlm.run.model import build_run_model

UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: a byte count or a size like 500MB, 5GB") from None


def shard_state(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def export(checkpoint: Path, out_dir: Path, max_shard_size: int = 5 * 10**9, overwrite: bool = False) -> Path:
    checkpoint = resolve_checkpoint_dir(Path(checkpoint))
    out_dir = Path(out_dir)
    run = str(checkpoint.resolve().parent.parent)  # the run's dump_dir: what the export records it came from
    keep = claim_out_dir(out_dir, checkpoint, run, overwrite)  # files of the user's to carry into the new export
    meta = verify(checkpoint)
    cfg = from_yaml(meta["config"])
    memory = cfg.memory if cfg.memory.places_layers() else None
    model = build_run_model(cfg)
    Checkpointer.load_weights(checkpoint, model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state = mode_of(cfg).export_state(state, cfg)  # what the fine-tune folds in (lora: merged adapters)
    check_finite(state, f"export of {checkpoint}", ExportError)
    dense = family_of(cfg.model.ffn).llama_equivalent and memory is None
    if dense:
        state = to_hf_state_dict(state, cfg.model)
        if cfg.model.tie_embeddings:
            state.pop("lm_head.weight")  # safetensors stores a tensor once; HF re-ties it
    with atomic_output_dir(out_dir) as new_dir:  # swapped in at the end: a killed export leaves the old one whole
        write_export(new_dir, cfg, checkpoint, meta, state, max_shard_size, dense, memory, run, out_dir)
        write_manifest(new_dir)  # last: what this export wrote, and nothing else
        carry_over(out_dir, new_dir, keep)
    if keep:
        print(f"[export] kept {len(keep)} file(s) of {out_dir} that memlm did not write: {listing(keep)}")
    return out_dir


def write_export(out_dir: Path, cfg, checkpoint: Path, meta: dict, state: dict[str, torch.Tensor],
                 max_shard_size: int, dense: bool, memory, run: str, named: Path) -> None:
    """Every file of the export, into the empty folder out_dir (`named`: where it will be, for messages)."""
    shards = shard_state(state, max_shard_size)
    if len(shards) == 1:
        save_weights(shards[0], out_dir / WEIGHTS_NAME)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_weights(shard, out_dir / name)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out_dir / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    memlm_config = {
        "memlm_version": memlm.__version__, "step": meta["step"], "run": run,
        "weights_layout": "hf_llama" if dense else "memlm",
        "model": dataclasses.asdict(cfg.model), "memory": dataclasses.asdict(cfg.memory),
    }
    (out_dir / CONFIG_NAME).write_text(json.dumps(memlm_config, indent=2))
    write_data_config(cfg, out_dir)
    tokenizer = run_tokenizer_path(cfg, checkpoint)
    tokenizer = tokenizer if tokenizer and Path(tokenizer).is_file() else None
    kinds = sorted(set(layer_ffn_kinds(cfg.model, memory)))
    if not dense and all(family_of(kind).remote_code for kind in kinds):
        # config.json + trust_remote_code modeling files for the memlm-named weights above
        write_remote_code(out_dir, cfg.model, memory, extra=hf_token_ids(tokenizer))
    elif not dense:
        missing = [kind for kind in kinds if not family_of(kind).remote_code]
        print(f"[export] FFN kind(s) {', '.join(missing)} have no Hugging Face modeling code (hf/remote/): "
              f"{named} loads with memlm (memlm.hf.from_pretrained), not with transformers", flush=True)
    if dense:
        to_hf_config(cfg.model, torch_dtype="float32", architectures=["LlamaForCausalLM"],
                     **hf_token_ids(tokenizer)).save_pretrained(str(out_dir))
        portable_config_json(out_dir / "config.json", cfg.model.rope_theta)
    if tokenizer:
        shutil.copyfile(tokenizer, out_dir / "tokenizer.model")  # the umask's mode, not the source's
    write_hf_side_files(out_dir, tokenizer, cfg.model.max_seq_len)


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file(state, str(path), metadata={"format": "pt"})
    follow_umask(path)  # safetensors writes 0600; the rest of the export follows the umask


# -------------------------------------------------------------- out_dir
def claim_out_dir(out_dir: Path, checkpoint: Path, run: str, overwrite: bool) -> list[str]:
    """Whether the export may be written at out_dir (the rules of the module doc; OutputError
    naming why not). Returns the files of an earlier export that the user added, to keep."""
    check_output_path(out_dir, {checkpoint: "the checkpoint it exports"})
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OutputError(f"{out_dir} is {'a link' if out_dir.is_symlink() else 'a file'}, not a folder: "
                          "name a new folder for the export")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return []
    if not (out_dir / CONFIG_NAME).is_file():
        raise OutputError(f"{out_dir} is not empty and is not a memlm export (no {CONFIG_NAME}), so it is left "
                          "alone: choose a new or empty folder")
    try:
        files = read_manifest(out_dir)
        earlier = json.loads((out_dir / CONFIG_NAME).read_text()).get("run")
    except (ExportError, OSError, ValueError, AttributeError) as err:
        raise OutputError(f"{out_dir} is a memlm export memlm cannot tell its own files in ({err}), so it is "
                          "left alone: move or delete it yourself, or choose another folder") from None
    added = foreign_files(out_dir, files, exclude=[MANIFEST_NAME])
    if overwrite:
        if added:
            raise OutputError(f"{out_dir} holds files the export did not write ({listing(added)}): --overwrite "
                              "replaces a whole export, so it is left alone; move those files away first")
        return []
    if earlier != run:
        raise OutputError(f"{out_dir} is an export of another run ({earlier}), not of {run}: choose another "
                          "folder, or add --overwrite to replace it")
    changed = changed_files(out_dir, files)
    if changed:
        raise OutputError(f"{out_dir}: files of the earlier export were changed since it was written "
                          f"({listing(changed)}), so it is left alone: move them away, or add --overwrite to "
                          "replace them")
    return added


def carry_over(old: Path, new: Path, names: list[str]) -> None:
    """Put the user's files `names` of the earlier export `old` into the new export `new`: a hard
    link (no copy of a large `.git/`; the old folder goes only after the swap), else a copy; links
    stay links. One the new export also wrote is refused (nothing is replaced)."""
    for name in names:
        source, target = old / name, new / name
        if os.path.lexists(target):
            raise OutputError(f"{source} was not written by the earlier export, and this export writes a file "
                              "of that name: move it away first")
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
            continue
        try:
            os.link(source, target)
        except OSError:  # a file system without hard links
            shutil.copy2(source, target)


# -------------------------------------------------------------- data config
def write_data_config(cfg, out_dir: Path) -> None:
    """The run's data config as memlm_data.json: evaluations that ask about the
    training corpus (synthetic_qa) read it (memlm.run.load.data_config)."""
    from memlm.run.load import DATA_CONFIG_NAME

    payload = {"memlm_version": memlm.__version__, "data": dataclasses.asdict(cfg.data)}
    (out_dir / DATA_CONFIG_NAME).write_text(json.dumps(payload, indent=2))


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.hf.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory, its `latest` file, or a run's dump_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    parser.add_argument("--overwrite", action="store_true",
                        help="replace out_dir when it is a memlm export of another run, or one whose files were "
                             "changed; never a folder holding files the export did not write (refused, naming "
                             "them). The old folder goes only once the new export is complete")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir, args.max_shard_size, args.overwrite)
    except MemlmError as err:  # a missing, bad or non-finite checkpoint: one line (entry_point), the kind's exit code
        err.args = (f"cannot export {args.checkpoint}: {err}",)
        raise
    files = sorted(p.name for p in out.iterdir())
    print(f"[export] {resolve_checkpoint_dir(args.checkpoint)} -> {out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
