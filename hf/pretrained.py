"""Load an exported model: `memlm.hf.from_pretrained(out_dir)`.

An export directory (written by `python -m memlm.hf.export`) holds
`memlm_config.json` (model + memory config and the weight layout),
`model.safetensors` or shards listed in `model.safetensors.index.json`, and
for dense models a Hugging Face `config.json` (their weights use the HF Llama
names, so `transformers` loads the same directory); other models get a
`config.json` with `auto_map` and the modeling files of hf/remote/
(`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`).

A file of the folder that is missing, not JSON, not safetensors or not the
export's is an ExportError naming it, wherever the folder is read
(memlm.evals, memlm.generate, init_from): one line from any command.

Every export holds `memlm_manifest.json`: the size and crc32 of every file
the export wrote (memlm.files.folder_manifest), sealed with a crc32 of its
own. Each memlm read of an export checks it first (`verify_export`, once per
process while the files are unchanged): a missing, truncated or changed file
is an ExportError naming it. Files the manifest does not list (a model card
you added) are yours: never read, never checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from memlm.errors import MemlmError
from memlm.files import entry_fault, folder_manifest, json_crc32
from memlm.hf.mapping import from_hf_state_dict
from memlm.memory.config import MemoryConfig
from memlm.model.args import ModelArgs
from memlm.model.build import build_model
from memlm.model.transformer import Transformer

CONFIG_NAME = "memlm_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "memlm_manifest.json"  # {"files": {name: {"size", "crc32"}}, "manifest_crc32": seal}


class ExportError(MemlmError, RuntimeError):
    """An export (python -m memlm.hf.export) that cannot be written or read, or another safetensors
    model folder (a Hugging Face Llama) that cannot be read: names the file and the fault."""


REWRITE = "export the checkpoint again (python -m memlm.hf.export)"


def _dataclass_from(cls, values: dict[str, Any]):
    """cls(**values), a nested section (memory.engram) built as its own dataclass."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys in {CONFIG_NAME}: {unknown}")
    values = dict(values)
    for name, f in fields.items():
        if name in values and isinstance(values[name], dict) and f.default_factory is not dataclasses.MISSING:
            section = f.default_factory()
            if dataclasses.is_dataclass(section):
                values[name] = _dataclass_from(type(section), values[name])
    return cls(**values)


def read_json(path: Path) -> Any:
    """A JSON file of a model folder; ExportError naming it when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path} not found") from None
    except (OSError, ValueError) as err:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ExportError(f"{path} is not readable JSON ({err})") from None


def read_config(directory: str | Path) -> tuple[ModelArgs, MemoryConfig, dict[str, Any]]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ExportError(f"{path} not found: not a memlm export directory")
    try:
        meta = read_json(path)
        return _dataclass_from(ModelArgs, meta["model"]), _dataclass_from(MemoryConfig, meta["memory"]), meta
    except ExportError as err:
        raise ExportError(f"{err}; {REWRITE}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise ExportError(f"{path} is not a memlm export's config ({type(err).__name__}: {err}); {REWRITE}") from None


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a directory: the shards its index lists, or the single file."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except ExportError as err:  # not JSON
            raise ExportError(f"{index} is not a safetensors index ({str(err).removeprefix(f'{index} ')})") from None
        except (KeyError, TypeError, AttributeError) as err:
            raise ExportError(f"{index} is not a safetensors index with a weight_map "
                              f"({type(err).__name__}: {err})") from None
    else:
        names = [WEIGHTS_NAME]
    for name in names:
        if not (directory / name).is_file():
            raise ExportError(f"weight file {directory / name} is missing")
    if (directory / CONFIG_NAME).is_file():  # a memlm export (not a Llama's folder): its bytes are checked
        verify_export(directory)
    return [directory / name for name in names]


# ------------------------------------------------------------------ the manifest
def write_manifest(directory: str | Path) -> dict[str, dict[str, int]]:
    """Write the manifest of every file now in `directory` (the export, as written); returns its files."""
    import memlm

    directory = Path(directory)
    files = folder_manifest(directory, exclude=[MANIFEST_NAME])
    body = {"memlm_version": memlm.__version__, "files": files}
    (directory / MANIFEST_NAME).write_text(json.dumps({**body, "manifest_crc32": json_crc32(body)}, indent=1) + "\n")
    return files


def read_manifest(directory: str | Path) -> dict[str, dict[str, int]]:
    """The files an export wrote, {name: {"size", "crc32"}}, from its sealed manifest; ExportError
    naming the manifest when it is missing, malformed or changed."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ExportError(f"{path} is missing: the export cannot be checked (written by an older memlm, "
                          f"or not by python -m memlm.hf.export); {REWRITE}")
    manifest = read_json(path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    entries_ok = isinstance(files, dict) and all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("crc32"), int)
        for e in files.values())
    if not entries_ok:
        raise ExportError(f"{path} is not an export manifest ({{\"files\": {{name: {{\"size\", \"crc32\"}}}}}}); "
                          f"{REWRITE}")
    if manifest.get("manifest_crc32") != json_crc32({k: v for k, v in manifest.items() if k != "manifest_crc32"}):
        raise ExportError(f"{path} is corrupted or was edited: its manifest_crc32 does not match its content; "
                          f"{REWRITE}")
    return files


_VERIFIED: dict[Path, tuple] = {}  # export folder -> the stat of its files when last verified
SETTLED_S = 2.0  # a file last written this long before a check is remembered as checked (racy-git rule)


def _signature(directory: Path, files: dict[str, Any]) -> tuple:
    """What a change to the export's files would change: each one's size, mtime, ctime and inode."""
    signature = []
    for name in [MANIFEST_NAME, *sorted(files)]:
        try:
            st = os.stat(directory / name)
        except OSError:
            return ()
        signature.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(signature)


def verify_export(directory: str | Path) -> None:
    """Check every file of an export against its manifest (ExportError naming the first that is
    missing, truncated or corrupted). An export checked in this process is not hashed again while
    its files keep their stat; only files written SETTLED_S before the check are remembered, so
    a write within the clock's resolution of the check cannot hide (the racy-git rule)."""
    directory = Path(directory)
    files = read_manifest(directory)
    key, signature = directory.resolve(), _signature(directory, files)
    if signature and _VERIFIED.get(key) == signature:
        return
    checked_at = time.time_ns()
    for name, entry in files.items():
        fault = entry_fault(directory / name, entry)
        if fault is not None:
            raise ExportError(f"export file {directory / name} {fault}; {REWRITE}")
    if signature and all(checked_at - mtime > SETTLED_S * 1e9 for _, _, mtime, _, _ in signature):
        _VERIFIED[key] = signature


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """safe_open of a weight file; a file that is not safetensors, or is cut short (found while
    its tensors are read in the with block), is an ExportError naming it."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            yield fh
    except (SafetensorError, OSError) as err:
        raise ExportError(f"{path} is not a readable safetensors file ({err})") from None


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            with open_safetensors(path) as fh:
                state.update({key: fh.get_tensor(key) for key in fh.keys()})
        except ExportError as err:
            raise ExportError(f"{err}; {REWRITE}") from None
    return state


def from_pretrained(directory: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Build the exported model and load its weights (safetensors only, no pickle)."""
    args, memory, meta = read_config(directory)
    weight_files(directory)  # every file checked against the manifest before anything is built
    model = build_model(args, memory, device=device)
    state = load_weights(directory)
    if meta.get("weights_layout") == "hf_llama":
        state = from_hf_state_dict(state, args)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # missing, unexpected or mis-shaped tensors
        raise ExportError(f"the weights of {directory} do not fit its {CONFIG_NAME} "
                          f"({str(err).strip().splitlines()[0]}); {REWRITE}") from None
    return model.eval()
