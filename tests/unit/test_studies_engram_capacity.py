"""The capacity report's Engram lines (memlm.studies.engram_capacity) from made-up rows."""

from __future__ import annotations

from memlm.studies.engram_capacity import engram_lines
from memlm.studies.value_lr import default_levers


def _row(variant, bits, seed=0, lr=0.01, lever="", flops=1000):
    return {"variant": variant, "entities": 8000, "stored_bits": bits, "seed": seed, "value_lr": lr,
            "lever": lever, "flops": flops, "corpus_bits": 256_000}


def _runs_at(rows):
    def runs_at(variant, entities, lr):
        found = [r for r in rows if r["variant"] == variant and r["entities"] == entities and not r["lever"]]
        return [r for r in found if lr is None or r["value_lr"] == lr]
    return runs_at


def test_each_variant_against_memory_plus_and_dense_with_the_flops():
    rows = [_row("Engram", 250_000, flops=1012), _row("Memory+", 100_000), _row("Memory+", 110_000, seed=1),
            _row("Memory+", 200_000, lr=0.1, lever=default_levers()), _row("Dense", 25_000, lr=None, flops=960)]
    lines = engram_lines(rows, 8000, _runs_at(rows))
    assert lines[0].startswith("- Engram at N = 8,000, value lr 0.01, stores 250,000 bits (1 seed), 97.7% of the "
                               "corpus's 256,000: 2.38x Memory+'s bits at the same value lr 0.01 (105,000 (mean of 2 "
                               "seeds: 100,000, 110,000); its active FLOPs/token 1,000, ours 1.012x); 1.25x Memory+'s "
                               "at its default levers")
    assert "10.00x Dense's (25,000; its active FLOPs/token 960, ours 1.054x)." in lines[0]
    assert lines[1].startswith("  That is 97.7% of what the corpus holds")
    assert "the shape needs three shares or more" in lines[2]


def test_the_share_curve_names_an_inside_peak_and_its_absence():
    rows = [_row("Memory+", 100_000), _row("Engram 25% + Memory+", 180_000), _row("Engram 50% + Memory+", 150_000),
            _row("Engram", 120_000)]
    line = engram_lines(rows, 8000, _runs_at(rows))[-1]
    assert line.endswith("0%: 100,000, 25%: 180,000, 50%: 150,000, 100%: 120,000: an inverted U, the most at 25% to "
                         "Engram (the paper's loss is lowest at 20-25%) (180,000).")
    rows[-1]["stored_bits"] = 250_000
    line = engram_lines(rows, 8000, _runs_at(rows))[-1]
    assert line.endswith("no peak inside: the most at 100% to Engram (250,000).")
    rows[1]["stored_bits"] = 249_000  # 25% and 100% both at the corpus's ceiling (at least 95% of 256,000)
    line = engram_lines(rows, 8000, _runs_at(rows))[-1]
    assert line.endswith("no peak inside: the most at 100% to Engram; bounded by the corpus: 25%, 100% each hold at "
                         "least 95% of its 256,000 bits, so this N cannot place a peak among them (250,000).")


def test_no_engram_run_no_line():
    rows = [_row("Memory+", 100_000), _row("Dense", 25_000, lr=None)]
    assert engram_lines(rows, 8000, _runs_at(rows)) == []
