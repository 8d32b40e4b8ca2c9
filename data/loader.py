"""The training data loader: `build_loader(cfg, rank, world_size)` is the one entry point.

Contract
--------
    loader = build_loader(cfg.data, rank, world_size, split="train")
    loader.vocab_size            # set model.vocab_size >= this (the tokenizer's size, or data.vocab_size)
    loader.tokenizer             # memlm.data.tokenizer.Tokenizer, None for kind=random
    inputs, targets = next(loader)   # int64 tensors (micro_batch, seq_len); targets = inputs shifted by one
    state = loader.state_dict()      # small JSON-able dict: save it per rank with every checkpoint
    loader.load_state_dict(state)    # the next batches are exactly those an uninterrupted run yields
    loader.reshard_state_dict(states)  # states of every rank of a run on another world size: same global stream

    loader = build_loader(cfg.data, rank, world_size, doc_ids=True)   # for model.doc_mask
    inputs, targets, doc_ids = next(loader)  # doc_ids (micro_batch, seq_len) int64: document number in the row

- The stream is infinite: epochs roll over inside it (each source reshuffles
  its documents every epoch, seeded), so iterate with next() and stop by steps.
- Documents end in EOS and are packed back to back into windows of seq_len + 1
  tokens; a window may span documents and epochs, no token is dropped.
- Sequences are numbered globally: global step t holds sequences
  [t*W*B, (t+1)*W*B) for world size W, micro batch B; rank r takes its B
  contiguous ones. Each sequence's source is drawn by a seeded, stratified
  sampler from the weights (memlm.data.stream.MixtureSchedule). Ranks thus read
  disjoint sequences, and one epoch is split among them without overlap.
- World-size change on resume: allowed, and deterministic. The state holds the
  global sequence position and each source's token position (identical on
  every rank), so a rank of the new world may load the state of any rank of
  the old one; the global stream continues exactly at the saved position, only
  its split into ranks changes. `reshard_state_dict(states)` is that rule for a
  checkpoint: it checks that the old ranks' states agree, then loads one. No
  rank reads or packs another rank's sequences: its own start follows
  arithmetically from the global position. micro_batch, seq_len and weights may
  change the same way. A different seed, split, kind or set of sources is an error.
- Document ids (`doc_ids=True`): token t of a row belongs to document
  number (count of EOS among inputs[:t]). Every document memlm stores ends in
  EOS and its text never encodes to EOS (the tokenizer emits no control ids),
  so this is exactly the packing's document split (an EOS belongs to the
  document it ends; the row's first document may have begun in the previous
  row). A pure function of the returned tokens: the state is the same with or
  without it. Sources without a tokenizer (kind=random) have no documents.
- `data.rows=documents` (DocumentRows): each row holds one document from its
  start (with its EOS), and the positions after it are padding: inputs 0,
  targets IGNORE (-100), which the loss skips (memlm.train.loss). A source's
  k-th row is its k-th document (epoch-major, in the epoch's order; with
  data.shuffle=false, file order), so the state counts documents instead of
  tokens. Every document must fit a row (seq_len + 1 tokens): a longer one is
  refused when the loader is built. With file order and micro_batch k, a
  corpus that lists each fact's k phrasings together gives batches of one
  fact each (Lin et al.'s sparse fine-tuning batches; docs/finetuning.md).
- Batches are made in a background thread (torchdata Prefetcher, `prefetch`
  batches ahead); the state always describes the batches *returned*, not the
  ones prefetched.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torchdata.nodes import BaseNode, Loader, Prefetcher

from memlm.data.config import IGNORE, DataConfig
from memlm.data.corpus import Corpus, open_corpus
from memlm.data.stream import MixtureSchedule
from memlm.errors import ConfigError

STATE_VERSION = 1
log = logging.getLogger("memlm.data")


class PackedBatches(BaseNode):
    """torchdata node yielding (inputs, targets) for one rank of the global sequence stream."""

    ROWS = "packed"  # data.rows

    def __init__(self, corpus: Corpus, seq_len: int, micro_batch: int, rank: int, world_size: int,
                 seed: int, split: str = "train", kind: str = ""):
        super().__init__()
        self.sources = corpus.sources
        self.names = [s.name for s in corpus.sources]
        self.schedule = MixtureSchedule(corpus.weights, seed)
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.rank, self.world_size = rank, world_size
        self.seed, self.split, self.kind = seed, split, kind
        self.global_seq = 0
        self.positions = np.zeros(len(self.sources), dtype=np.int64)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.global_seq = 0
        self.positions[:] = 0
        if initial_state is not None:
            self._restore(initial_state)

    def _restore(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError("data state version", state.get("version"), f"{STATE_VERSION} (from this memlm)")
        if state.get("rows", "packed") != self.ROWS:  # states of packed rows predate the key
            raise ConfigError("data.rows", self.ROWS, f"{state.get('rows', 'packed')!r}, the value of the run this "
                              "data state was saved from (its positions count other units)")
        for key in ("kind", "split", "seed"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"data.{key}", getattr(self, key),
                                  f"{state[key]!r}, the value of the run this data state was saved from")
        if sorted(state["positions"]) != sorted(self.names):
            raise ConfigError("data.sources", self.names,
                              f"the sources of the saved run: {sorted(state['positions'])}")
        if state["world_size"] != self.world_size:
            # Defined behaviour: continue the same global stream at the saved global position.
            log.warning("data: resuming a world_size=%d state with world_size=%d: continuing the global "
                        "stream at sequence %d with the new rank split", state["world_size"],
                        self.world_size, state["global_seq"])
        self.global_seq = int(state["global_seq"])
        self.positions[:] = [int(state["positions"][n]) for n in self.names]

    def _rows_of_step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(every global row's source, this rank's rows before it per source, this rank's rows' sources)
        of the step at global_seq: the k-th row of source s (over all ranks) is its k-th from positions[s]."""
        choice = self.schedule.choices(self.global_seq, self.world_size * self.micro_batch)
        first = self.rank * self.micro_batch
        before = np.bincount(choice[:first], minlength=len(self.sources))
        return choice, before, choice[first:first + self.micro_batch]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        # returns inputs, targets: (micro_batch, seq_len) int64
        width, n_rows = self.seq_len + 1, self.world_size * self.micro_batch
        # k-th sequence of source s (counted over all ranks) starts at positions[s] + k * width.
        choice, before, mine = self._rows_of_step()
        buf = np.empty((self.micro_batch, width), dtype=np.int64)
        for s in np.unique(mine).tolist():  # one vectorized fill per source
            rows = np.flatnonzero(mine == s)
            starts = self.positions[s] + (before[s] + np.arange(len(rows))) * width
            if len(rows) == self.micro_batch:
                self.sources[s].fill_rows(starts.tolist(), buf)
            else:
                part = np.empty((len(rows), width), dtype=np.int64)
                self.sources[s].fill_rows(starts.tolist(), part)
                buf[rows] = part
        self.positions += np.bincount(choice, minlength=len(self.sources)) * width
        self.global_seq += n_rows
        return torch.from_numpy(buf[:, :-1].copy()), torch.from_numpy(buf[:, 1:].copy())

    def get_state(self) -> dict:
        return {
            "version": STATE_VERSION, "kind": self.kind, "split": self.split, "seed": self.seed,
            "global_seq": self.global_seq, "positions": dict(zip(self.names, self.positions.tolist())),
            "epochs": {s.name: int(p) // s.tokens_per_epoch for s, p in zip(self.sources, self.positions)},
            "world_size": self.world_size, "rank": self.rank,
            "micro_batch": self.micro_batch, "seq_len": self.seq_len,
        }


class DocumentRows(PackedBatches):
    """data.rows=documents: one document per row, padded (module docstring). Positions count documents."""

    ROWS = "documents"

    def __init__(self, corpus: Corpus, seq_len: int, micro_batch: int, rank: int, world_size: int,
                 seed: int, split: str = "train", kind: str = ""):
        super().__init__(corpus, seq_len, micro_batch, rank, world_size, seed, split, kind)
        for source in self.sources:
            longest = int(source.doc_len.max())
            if longest > seq_len + 1:
                raise ConfigError("data.seq_len", seq_len, f"at least {longest - 1} with data.rows=documents: "
                                  f"source {source.name}'s longest document has {longest} tokens with its EOS, "
                                  "and a row holds one whole document (seq_len + 1 tokens)")

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        # returns inputs, targets: (micro_batch, seq_len) int64; targets IGNORE after each row's document
        width, n_rows = self.seq_len + 1, self.world_size * self.micro_batch
        choice, before, mine = self._rows_of_step()  # the k-th row of source s: its document positions[s] + k
        buf = np.zeros((self.micro_batch, width), dtype=np.int64)
        lengths = np.empty(self.micro_batch, dtype=np.int64)
        for s in np.unique(mine).tolist():
            rows = np.flatnonzero(mine == s)
            numbers = self.positions[s] + before[s] + np.arange(len(rows))
            part = np.zeros((len(rows), width), dtype=np.int64)
            lengths[rows] = self.sources[s].fill_documents(numbers, part)
            buf[rows] = part
        self.positions += np.bincount(choice, minlength=len(self.sources))
        self.global_seq += n_rows
        targets = buf[:, 1:].copy()
        targets[np.arange(self.seq_len)[None, :] >= lengths[:, None] - 1] = IGNORE  # no next token of the document
        return torch.from_numpy(buf[:, :-1].copy()), torch.from_numpy(targets)

    def get_state(self) -> dict:
        state = super().get_state()
        state["rows"] = self.ROWS
        state["epochs"] = {s.name: int(p) // s.num_docs for s, p in zip(self.sources, self.positions)}
        return state


NODES = {node.ROWS: node for node in (PackedBatches, DocumentRows)}  # data.rows -> its node


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(rows, seq) int64 document number of each token: the EOS tokens before it in its row."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(dim=1) - ends  # exclusive: an EOS still belongs to the document it ends


class TokenLoader:
    """An infinite iterator of (inputs, targets), or (inputs, targets, doc_ids) when built
    with doc_ids=True, with state_dict / load_state_dict (see module docstring)."""

    def __init__(self, node: PackedBatches, corpus: Corpus, prefetch: int = 2, doc_ids: bool = False):
        self.node = node
        self.doc_ids = doc_ids
        if doc_ids and corpus.tokenizer is None:
            raise ConfigError("data.kind", node.kind, "a corpus with documents and a tokenizer (their EOS "
                              "marks the boundaries) for document ids (model.doc_mask=true)")
        self.prefetch = prefetch
        self.tokenizer = corpus.tokenizer
        self.vocab_size = corpus.vocab_size
        self.stats = corpus.stats
        self.weights = list(corpus.weights)
        root = Prefetcher(node, prefetch_factor=prefetch, snapshot_frequency=1) if prefetch > 0 else node
        self._loader = Loader(root, restart_on_stop_iteration=False)
        self._it = None

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id if self.tokenizer is not None else -1

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        if self._it is None:
            self._it = iter(self._loader)
        inputs, targets = next(self._it)
        return (inputs, targets, document_ids(inputs, self.eos_id)) if self.doc_ids else (inputs, targets)

    def state_dict(self) -> dict:
        """The node's state after the last returned batch, independent of the prefetch setting."""
        state = self._loader.state_dict()
        root = state["root"]
        if self.prefetch > 0:
            assert root["steps_since_snapshot"] == 0, "snapshot_frequency=1 keeps every state exact"
            root = root["snapshot"]
        return dict(root)

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "global_seq" not in state:
            raise ConfigError("data state", type(state).__name__, "a dict from TokenLoader.state_dict()")
        root = {"snapshot": state, "steps_since_snapshot": 0} if self.prefetch > 0 else state
        self._loader.load_state_dict({"root": root, "num_yielded": 0})
        self._it = iter(self._loader)  # apply now, so state_dict() reflects the loaded state at once

    def reshard_state_dict(self, states: list[dict]) -> None:
        """Resume from the states of every rank of a run on another number of ranks (any world size).

        The global position is the same in every rank's state, so this checks that
        they agree (one checkpoint, every rank present), then loads it: the global
        stream continues at that position, split over this world's ranks."""
        if not states or not all(isinstance(s, dict) and "global_seq" in s for s in states):
            raise ConfigError("data state", [type(s).__name__ for s in states],
                              "one dict from TokenLoader.state_dict() per rank of the saved run")
        old_world = states[0]["world_size"]
        if sorted(s["rank"] for s in states) != list(range(old_world)):
            raise ConfigError("data state ranks", sorted(s["rank"] for s in states),
                              f"the states of all {old_world} ranks of the saved run, ranks 0..{old_world - 1}")
        for key in ("global_seq", "positions", "seed", "split", "kind", "world_size"):
            values = [s[key] for s in states]
            if any(v != values[0] for v in values):
                raise ConfigError(f"data state {key}", values,
                                  "the same value on every rank (states saved by one checkpoint)")
        self.load_state_dict(states[0])

    def describe(self) -> str:
        parts = [f"{s.name} (weight {w:.3g}, {s.tokens_per_epoch:,} tokens/epoch)"
                 if s.num_docs else s.name for s, w in zip(self.node.sources, self.weights)]
        skipped = [f"{n}: {st.summary()}" for n, st in self.stats.items()]
        return (f"data: {self.node.kind}, split {self.node.split}, rank {self.node.rank}/{self.node.world_size}, "
                f"vocab {self.vocab_size}, sources: {', '.join(parts)}"
                + ("; " + "; ".join(skipped) if skipped else ""))


def build_loader(cfg: DataConfig, rank: int = 0, world_size: int = 1, split: str = "train",
                 doc_ids: bool = False) -> TokenLoader:
    """The loader of one rank, built from the data config (every file is opened and checked here);
    `doc_ids=True` adds each token's document number to every batch (see module docstring)."""
    cfg.validate()
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError("rank", (rank, world_size), "0 <= rank < world_size, world_size >= 1")
    corpus = open_corpus(cfg, split)
    for name, stats in corpus.stats.items():
        if stats.total_skipped:
            log.warning("data: source %s: %s", name, stats.summary())
    node = NODES[cfg.rows](corpus, cfg.seq_len, cfg.micro_batch, rank, world_size, cfg.seed, split, cfg.kind)
    return TokenLoader(node, corpus, cfg.prefetch, doc_ids)
