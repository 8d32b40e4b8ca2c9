"""The capacity report's lines on Engram (issue #51), generated from the records.

    lines = engram_lines(rows, entities, runs_at)   # rows: memlm.studies.capacity_report.load_runs's;
                                                    # runs_at(variant, entities, value_lr) -> its runs

- Each Engram variant (alone, or beside Memory+ at a share of one sparse budget) against Memory+ at
  the same value lr (equal learning), Memory+ at `memory=memplus`'s default levers (its best value lr
  there), and Dense, with each one's active FLOPs per token beside it.
- How much of the corpus it holds: bits stored cannot exceed the corpus's, so a variant near that
  ceiling is bounded by the corpus, not by its memory.
- Bits stored against the share of the sparse budget given to Engram (0: Memory+ alone at the same
  value lr, 1: Engram alone), and whether they peak inside (an inverted U: the paper's U-shaped law
  is in loss, lower is better, with its best at 20-25% to Engram).
"""

from __future__ import annotations

from collections.abc import Callable

from memlm.studies.value_lr import best, default_levers, mean_bits, said, said_bits

# The capacity report's Engram variants and their share of the sparse budget (memory.engram.share);
# Memory+ alone is share 0.
SHARES = {"Memory+": 0.0, "Engram 25% + Memory+": 0.25, "Engram 50% + Memory+": 0.5, "Engram": 1.0}
SATURATED = 0.95  # a share of the corpus's bits from which a variant is bounded by the corpus


def _held(runs: list[dict]) -> float:
    """The share of the corpus's bits these runs store (their mean)."""
    return mean_bits(runs) / runs[0]["corpus_bits"]


def _against(ours: list[dict], theirs: list[dict], what: str) -> str:
    return (f"{mean_bits(ours) / max(mean_bits(theirs), 1e-9):.2f}x {what} ({said(theirs)}; its active FLOPs/token "
            f"{theirs[0]['flops']:,}, ours {ours[0]['flops'] / theirs[0]['flops']:.3f}x)")


def _memplus_at_defaults(rows: list[dict], entities: int) -> list[dict]:
    """Memory+'s runs at `memory=memplus`'s default levers, at the value lr where they store the most."""
    levers = default_levers()
    groups: dict[float, list[dict]] = {}
    for r in rows:
        if r["variant"] == "Memory+" and r["entities"] == entities and r["lever"] == levers:
            groups.setdefault(r["value_lr"], []).append(r)
    return best(list(groups.items()))[1] if groups else []


def engram_lines(rows: list[dict], entities: int, runs_at: Callable[[str, int, float | None], list[dict]]) -> list[str]:
    out = []
    dense = runs_at("Dense", entities, None)
    defaults = _memplus_at_defaults(rows, entities)
    for variant in [v for v in SHARES if v != "Memory+"]:
        ours = runs_at(variant, entities, None)
        if not ours:
            continue
        lr = ours[0]["value_lr"]
        parts = []
        if same_lr := runs_at("Memory+", entities, lr):
            parts.append(_against(ours, same_lr, f"Memory+'s bits at the same value lr {lr:g}"))
        if defaults:
            parts.append(_against(ours, defaults, f"Memory+'s at its default levers (`{default_levers()}`, value lr "
                                                  f"{defaults[0]['value_lr']:g})"))
        if dense:
            parts.append(_against(ours, dense, "Dense's"))
        corpus, held = ours[0]["corpus_bits"], _held(ours)
        out.append(f"- {variant} at N = {entities:,}, value lr {lr:g}, stores {said_bits(ours)}, "
                   f"{held:.1%} of the corpus's {corpus:,.0f}: " + "; ".join(parts) + ".")
        if held >= SATURATED:
            out.append(f"  That is {held:.1%} of what the corpus holds: at this N the comparison is bounded by the "
                       "corpus, not by the memory (a larger N would separate it from the others further).")
    out += _share_line(entities, runs_at)
    return out


def _share_line(entities: int, runs_at: Callable[[str, int, float | None], list[dict]]) -> list[str]:
    engram = runs_at("Engram", entities, None)
    lr = engram[0]["value_lr"] if engram else None
    points = [(share, runs) for variant, share in SHARES.items()
              if (runs := runs_at(variant, entities, lr if variant == "Memory+" else None))]
    if not engram:
        return []
    said_points = ", ".join(f"{share:.0%}: {said(runs)}" for share, runs in points)
    if len(points) < 3:
        return [f"- Bits stored against Engram's share of the sparse budget at N = {entities:,} (Memory+ at value lr "
                f"{lr:g} as share 0): {said_points}; the shape needs three shares or more, not measured yet."]
    peak_share, peak = max(points, key=lambda p: mean_bits(p[1]))
    inside = 0 < peak_share < 1
    shape = (f"an inverted U, the most at {peak_share:.0%} to Engram (the paper's loss is lowest at 20-25%)" if inside
             else f"no peak inside: the most at {peak_share:.0%} to Engram")
    corpus = peak[0]["corpus_bits"]
    full = [share for share, runs in points if _held(runs) >= SATURATED]
    if len(full) > 1:  # two shares at the corpus's ceiling: their order is not capacity's
        shape += (f"; bounded by the corpus: {', '.join(f'{s:.0%}' for s in full)} each hold at least "
                  f"{SATURATED:.0%} of its {corpus:,.0f} bits, so this N cannot place a peak among them")
    return [f"- Bits stored against Engram's share of the sparse budget at N = {entities:,} (Memory+ at value lr "
            f"{lr:g} as share 0): {said_points}: {shape} ({mean_bits(peak):,.0f})."]
