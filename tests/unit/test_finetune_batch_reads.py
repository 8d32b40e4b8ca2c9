"""The share of a value table one batch reads (memlm.finetune.background.collect): what bounds the
rows a sparse fine-tuning step can change, measured per table, a shared pool counted once; and how
many batches read each slot (the background of finetune.ranking=tfidf_batches)."""

from __future__ import annotations

import torch

from memlm.config.run import compose
from memlm.finetune.background import collect, describe_batch_reads, memory_layers, value_tables
from memlm.memory.usage import reset_usage
from memlm.model import Transformer

SHARED = ["model.vocab_size=128", "model.dim=32", "model.n_layers=3", "model.n_heads=2", "memory=memplus",
          "memory.layers=[0,2]", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16",
          "memory.heads=2"]


def test_each_batch_reads_the_union_of_its_layers_slots_of_the_shared_table():
    torch.manual_seed(0)
    cfg = compose(SHARED)
    model = Transformer(cfg.model, cfg.memory)
    model.init_weights()
    layers = memory_layers(model)
    assert value_tables(layers) == {"layer0+layer2": ["layer0", "layer2"]}  # one pool, read by both layers
    batches = [(torch.randint(0, 128, (1, 8)), None) for _ in range(3)]
    counts, tokens, batch_read, batches_read = collect(model, iter(batches), 3, torch.device("cpu"))
    assert tokens == 3 * 8 and set(batch_read) == {"layer0+layer2"}
    expected, documents = [], torch.zeros(256, dtype=torch.int64)
    for inputs, _ in batches:  # the reference: one batch at a time from zeroed counters
        reset_usage(model)
        model(inputs)
        read = layers["layer0"].usage.counts + layers["layer2"].usage.counts
        expected.append(float((read > 0).sum()) / 256)
        documents += read > 0
    assert batch_read["layer0+layer2"] == expected and 0 < min(expected) <= max(expected) < 1
    # How many of the batches read each slot of the table (Lin et al.'s document frequency).
    assert set(batches_read) == {"layer0+layer2"} and torch.equal(batches_read["layer0+layer2"], documents)
    assert 0 < int(documents.max()) <= 3 and int((documents > 0).sum()) < 256
    line, = describe_batch_reads(batch_read, {"layer0+layer2": 256}, "1 x 8 tokens")
    assert line.startswith(f"layer0+layer2: one batch (1 x 8 tokens) reads {sum(expected) / 3:.1%} of its 256 "
                           f"slots (mean of 3 batches, {min(expected):.1%}-{max(expected):.1%})")
