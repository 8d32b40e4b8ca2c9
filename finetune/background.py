"""Background slot usage: how often a model's reads hit each memory slot, the
reference that sparse fine-tuning ranks a batch's reads against
(finetune=sparse; memlm.finetune.selection; memory/slot_selection.py).

    counts, tokens, read, docs = collect(model, batches, n_batches, device)  # {"layer4": (n_slots,) int64}
    read["layer4"]                                                # share of that table each batch read
    docs["layer4"]                                                # (n_slots,): how many batches read each slot
    save_usage(path, counts, tokens, source, docs, n_batches)     # slot_usage.safetensors
    background = load_usage(path, {"layer4": n_slots})            # checked against the model
    docs, n = load_batches_read(path, ["layer4"])                 # finetune.ranking=tfidf_batches's background
    recorder = UsageRecorder(model, steps, last_steps, ...)       # a pretraining run's own background

The command that writes one from any model a run can start from is
`python -m memlm.train.slot_usage` (train/slot_usage.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from memlm.errors import ConfigError
from memlm.files import follow_umask
from memlm.memory.usage import SlotUsage, reset_usage, usage_name

FILE = "slot_usage.safetensors"


def memory_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The memory layers that count their reads per table row, by usage name ("layer4", "engram1"):
    each has `usage` (memlm.memory.usage.SlotUsage), `values` (its value pool) and `row_tables()` (the
    tables those rows address: product-key memory's values; UltraMemV2's V and P; Engram's n-gram table)."""
    return {usage_name(m): m for m in model.modules() if callable(getattr(m, "row_tables", None))}


def layer_counts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each memory layer's read counter since its last reset, copied to the CPU."""
    return {name: layer.usage.counts.detach().cpu().clone() for name, layer in memory_layers(model).items()}


# A table's batches-read counts in the file: "batches_read:<table label>" (value_tables' labels).
BATCHES_READ = "batches_read:"


def save_usage(path: Path, counts: dict[str, torch.Tensor], tokens: int, source: str,
               batches_read: dict[str, torch.Tensor] | None = None, n_batches: int = 0) -> None:
    """The layers' read counts, and per value table how many of the `n_batches` batches (of
    tokens / n_batches tokens each: the metadata's batch_tokens) read each slot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp_{path.name}")
    tensors = {**counts, **{BATCHES_READ + label: d for label, d in (batches_read or {}).items()}}
    batches = {"batches": str(n_batches), "batch_tokens": str(tokens // max(n_batches, 1))} if batches_read else {}
    metadata = {"tokens": str(tokens), "source": source, **batches}
    save_file({k: v.to(torch.int64).contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    follow_umask(tmp)  # safetensors writes 0600
    tmp.replace(path)


def usage_metadata(path: Path) -> dict[str, str]:
    """What save_usage recorded with the counts ({"tokens", "source"}, and where it counted the batches
    reading each slot "batches" and "batch_tokens"); {} for a file it did not write."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
    except (SafetensorError, OSError):
        return {}
    return metadata if "tokens" in metadata and "source" in metadata else {}


def is_usage_file(path: Path) -> bool:
    """Whether `path` is a file save_usage wrote (its metadata names the tokens counted and the source)."""
    return bool(usage_metadata(path))


def load_usage(path: str | Path, layers: dict[str, int]) -> dict[str, torch.Tensor]:
    """The background counts of `layers` ({name: n_slots}); a ConfigError
    (finetune.background) names what is missing or the wrong size."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("finetune.background", str(path), "a slot-usage file (python -m memlm.train.slot_usage "
                          "<checkpoint> writes slot_usage.safetensors beside it)")
    try:
        counts = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise ConfigError("finetune.background", str(path), f"a safetensors file ({err})") from None
    for name, n_slots in layers.items():
        got = counts.get(name)
        if got is None or got.shape != (n_slots,):
            found = "missing" if got is None else f"of shape {tuple(got.shape)}"
            raise ConfigError("finetune.background", str(path), f"counts for every memory layer of this model: "
                              f"{name} is {found}, expected ({n_slots},) (was it collected from this model?)")
    return {name: counts[name] for name in layers}


def load_batches_read(path: str | Path, tables: list[str]) -> tuple[dict[str, torch.Tensor], int]:
    """Per value table (its label) how many background batches read each slot, and how many batches
    there were: the background of a ranking by batches (memory/slot_selection.py BY_BATCHES)."""
    path = Path(path)
    n_batches = int(usage_metadata(path).get("batches", 0))
    with safe_open(str(path), framework="pt") as fh:
        found = {k.removeprefix(BATCHES_READ): fh.get_tensor(k) for k in fh.keys() if k.startswith(BATCHES_READ)}
    missing = [label for label in tables if label not in found]
    if missing or n_batches < 1:
        raise ConfigError("finetune.background", str(path), f"a slot-usage file that counts the batches reading "
                          f"each slot (for finetune.ranking=tfidf_batches; this one lacks "
                          f"{', '.join(missing) or 'its batch count'}): count it again with "
                          "python -m memlm.train.slot_usage")
    return {label: found[label] for label in tables}, n_batches


def describe(counts: dict[str, torch.Tensor]) -> list[str]:
    """One line per layer: slots read, share of reads on the 1% most-read slots, KL from uniform."""
    lines = []
    for name, c in counts.items():
        m = SlotUsage(c.numel()).metrics(c)
        if not m:
            lines.append(f"{name}: no reads")
            continue
        lines.append(f"{name}: {int(m['reads']):,} reads, {m['usage']:.1%} of {c.numel():,} slots read, "
                     f"top 1% of slots take {m['top1pct_share']:.1%} of the reads, "
                     f"KL from uniform {m['kl_uniform']:.3f} nats")
    return lines


class StepReads:
    """Each memory layer's reads since `start()`. The layers' usage counters
    (memory/usage.py) only grow; a step's reads are the difference.

        reads = StepReads(memory_layers(model)); reads.start(); trainer.train_step(); reads.since("layer1")
    """

    def __init__(self, layers: dict[str, torch.nn.Module]):
        self.layers = layers
        self._before: dict[str, torch.Tensor] = {}

    @property
    def started(self) -> bool:
        return bool(self._before)

    def start(self) -> None:
        self._before = {name: layer.usage.counts.clone() for name, layer in self.layers.items()}

    def since(self, name: str) -> torch.Tensor:
        """(n_slots,) int64 reads of layer `name` since start()."""
        return self.layers[name].usage.counts - self._before[name]

    def stop(self) -> None:
        self._before = {}


class UsageRecorder:
    """checkpoint.slot_usage_steps=N: the reads of every memory layer over a
    run's last N steps, summed over the ranks and written beside its final
    checkpoint, so a finished pretraining run carries its own background.
    It sits on the training loop's points (memlm.train.extensions):

        recorder.step_start(step); trainer.train_step(); recorder.step_end(step, run)
        recorder.end(step, run)   # the run reached its last step: write beside run.saved ...
        recorder.close()          # ... once the checkpointer has published it (every rank: a collective)
    """

    def __init__(self, model: torch.nn.Module, total_steps: int, last_steps: int, tokens_per_step: int,
                 distributed: bool, dump_dir: Path, is_main: bool):
        self.layers = memory_layers(model) if last_steps else {}
        self.first = max(1, total_steps - last_steps + 1)  # steps counted from 1: record steps first .. total
        self.tokens_per_step, self.distributed = tokens_per_step, distributed
        self.dump_dir, self.is_main = Path(dump_dir), is_main
        self.counts = {name: torch.zeros_like(layer.usage.counts) for name, layer in self.layers.items()}
        self.tables = value_tables(self.layers)
        # Per table, the steps (each rank's batch one document) that read each slot.
        self.batches_read = {label: torch.zeros_like(self.layers[names[0]].usage.counts)
                             for label, names in self.tables.items()}
        self.tokens = self.batches = 0
        self._reads = StepReads(self.layers)
        self._ended = None  # the loop's record, once the run reached its last step

    def _on(self, step: int) -> bool:
        return bool(self.layers) and step >= self.first

    def step_start(self, step: int) -> None:
        if self._on(step):
            self._reads.start()

    def step_end(self, step: int, run: object = None) -> None:
        if self._on(step) and self._reads.started:
            for name in self.layers:
                self.counts[name] += self._reads.since(name)
            for label, names in self.tables.items():
                self.batches_read[label] += sum(self._reads.since(n) for n in names) > 0
            self.tokens += self.tokens_per_step
            self.batches += 1
            self._reads.stop()

    def end(self, step: int, run) -> None:
        # The final checkpoint (run.saved) is chosen later in this same pass and written
        # in the background until the checkpointer's close: the file goes in at close.
        self._ended = run

    def close(self) -> None:
        if self._ended is None:
            return
        directory = self._ended.saved or self.dump_dir
        if (written := self.write(directory, self.is_main)) is not None:
            print(f"[train] slot usage of the last {self.tokens:,} tokens -> {written}", flush=True)

    def write(self, directory: Path, is_main: bool) -> Path | None:
        if not self.layers or not self.tokens:
            return None
        counts, batches_read = dict(self.counts), dict(self.batches_read)
        batches = self.batches
        if self.distributed:  # every rank's batch of a step is one document
            counts = {name: c.clone() for name, c in counts.items()}
            batches_read = {label: d.clone() for label, d in batches_read.items()}
            for c in [*counts.values(), *batches_read.values()]:
                dist.all_reduce(c)
            batches *= dist.get_world_size()
        if not is_main:
            return None
        path = Path(directory) / FILE
        save_usage(path, {k: v.cpu() for k, v in counts.items()}, self.tokens, f"the last {self.tokens:,} "
                   f"training tokens of {directory}", {k: v.cpu() for k, v in batches_read.items()}, batches)
        return path


@torch.no_grad()
def value_tables(layers: dict[str, torch.nn.Module]) -> dict[str, list[str]]:
    """Each value table by its label -> the names of the layers that read it: a pool that
    several layers share (Memory+) is one table, "layer1+layer3"."""
    tables: dict[int, list[str]] = {}
    for name, layer in layers.items():
        tables.setdefault(id(layer.values.weight), []).append(name)
    return {"+".join(names): names for names in tables.values()}


def collect(model: torch.nn.Module, batches, n_batches: int, device: torch.device
            ) -> tuple[dict[str, torch.Tensor], int, dict[str, list[float]], dict[str, torch.Tensor]]:
    """Read counts of every memory layer over `n_batches` of `batches`
    ((inputs, targets[, doc_ids]) tuples), the tokens read, and per value table
    (value_tables) the share of its slots each batch read (the rows a fine-tuning
    step on such a batch can change: finetune=sparse keeps top_t of them) and
    how many of the batches read each slot."""
    model.train()  # the memory layers count reads in training mode, at the training knn
    reset_usage(model)
    layers = memory_layers(model)
    tables = value_tables(layers)
    reads, batch_read = StepReads(layers), {label: [] for label in tables}
    batches_read = {label: torch.zeros_like(layers[names[0]].usage.counts) for label, names in tables.items()}
    tokens = 0
    for _ in range(n_batches):
        inputs, _, *doc = next(batches)
        doc_ids = doc[0].to(device) if doc else None
        reads.start()
        model(inputs.to(device), doc_ids=doc_ids)
        for label, names in tables.items():
            read = sum(reads.since(n) for n in names)
            batch_read[label].append(float((read > 0).sum()) / read.numel())
            batches_read[label] += read > 0
        tokens += inputs.numel()
    counts = layer_counts(model)
    reset_usage(model)
    return counts, tokens, batch_read, {label: d.cpu() for label, d in batches_read.items()}


def describe_batch_reads(batch_read: dict[str, list[float]], n_slots: dict[str, int], batch: str) -> list[str]:
    """One line per value table: the share of its slots one batch reads (mean, min-max)."""
    return [f"{label}: one batch ({batch}) reads {sum(s) / len(s):.1%} of its {n_slots[label]:,} slots "
            f"(mean of {len(s)} batches, {min(s):.1%}-{max(s):.1%})" for label, s in batch_read.items() if s]
