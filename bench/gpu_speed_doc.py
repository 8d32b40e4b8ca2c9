"""The "## GPU speed (bench/gpu_speed.py)" section of docs/benchmarks.md: each part's JSON as markdown.

    write_part(doc, HEADINGS["train"], MARKDOWN["train"](result))  # one part's block, the others kept
    write_doc(out_dir, doc)   # every part whose JSON a run left in out_dir (`python bench/gpu_speed.py doc`)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from report import write_section

TITLE = "## GPU speed (bench/gpu_speed.py)"
GOAL_TOKENS_RATIO = 0.9  # issue #49: Memory+ / dense tokens per second
HEADINGS = {"kernels": "Kernels", "sweep": "Launch sweep", "train": "Training step", "profile": "Profile"}


def write_part(doc: Path, heading: str, body: str) -> None:
    """Replace the "### heading" part of TITLE's section in `doc`, keep the others."""
    text = doc.read_text() if doc.exists() else ""
    section = re.search(rf"^{re.escape(TITLE)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    parts = re.findall(r"^(### .*?)(?=^### |\Z)", section.group(1), re.S | re.M) if section else []
    kept = [p.strip() for p in parts if not p.startswith(f"### {heading}\n")]
    new = f"### {heading}\n\n{body.strip()}"
    order = list(HEADINGS.values())
    blocks = sorted([*kept, new], key=lambda p: next((i for i, h in enumerate(order) if p.startswith(f"### {h}\n")),
                                                     len(order)))
    write_section(TITLE, "\n\n".join(blocks), doc)


def header(result: dict, what: str) -> str:
    dry = "**DRY RUN on CPU: plumbing only, not speeds.**\n\n" if result.get("dry_run") else ""
    return f"{dry}{result.get('machine', '')} Commit {result.get('commit', '?')}. {what}"


def kernels_md(result: dict) -> str:
    import speed_kernels as sk

    return sk.kernels_markdown(result, header(result, "Kernels at the paper's read."))


def sweep_md(result: dict) -> str:
    from launch_sweep import sweep_markdown

    lines = [header(result, "Median of the timed calls; each candidate checked against the float32 reference.")]
    for s in result.get("sweeps", {}).values():
        lines += sweep_markdown(s)
    return "\n".join(lines)


def train_md(result: dict) -> str:
    import device_train as dt

    variants = dt._variants(result.get("dry_run", False))
    model, memplus = " ".join(variants["dense"]), " ".join(variants["memplus"][len(variants["dense"]):])
    lines = [header(result, f"`{model}`, random tokens, the real Trainer; Memory+ adds `{memplus}` (fp32 table "
                            "unless bf16); mean step time over the timed steps after warm-up; compiled = "
                            "`parallel.compile=true` (its first step includes the compilation); peak memory "
                            "reset between models."), "",
             "Read kernels' launches (the sweep's fastest, as config values): " + "; ".join(
                 f"{k}: `{' '.join(v)}`" if v else f"{k}: the rule's" for k, v in result.get("launches", {}).items())
             + ".", "",
             "| model | mode | step | tokens/s | TFLOP/s | MFU | peak memory | first step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result.get("results", []):
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops']:.1f} | {mfu} | {mem} | {r['first_step_s']:.1f} s |")
    lines += ["", *(f"- {k} / dense tokens/s: {v:.2f}x (goal >= {GOAL_TOKENS_RATIO})."
                    for k, v in result.get("ratios", {}).items())]
    return "\n".join(lines)


def profile_md(result: dict) -> str:
    lines = [header(result, "One training step per model under torch.profiler after 2 warm-up steps; each "
                            "kernel's device time counted once (bench/speed_profile.py says how ops are "
                            "assigned to parts).")]
    for variant, s in result.get("steps", {}).items():
        parts, kind = s["parts_ms"], "device" if s["device_time"] else "CPU"
        lines += ["", f"**{variant}**: {s['wall_s'] * 1e3:.0f} ms wall, {parts['total']:.1f} ms of {kind} time.", "",
                  "| part | time | share |", "|---|---:|---:|"]
        lines += [f"| {k} | {parts[k]:.2f} ms | {v:.1%} |" for k, v in s["shares"].items()]
        lines += ["", "| largest ops (own device time) | part | time | calls |", "|---|---|---:|---:|"]
        lines += [f"| `{o['op'][:90]}` | {o['part']} | {o['ms']:.2f} ms | {o['calls']} |" for o in s["ops"][:8]]
    return "\n".join(lines)


MARKDOWN = {"kernels": kernels_md, "sweep": sweep_md, "train": train_md, "profile": profile_md}
JSON_NAMES = {"kernels": "speed_kernels.json", "sweep": "speed_sweep.json", "train": "speed_train.json",
              "profile": "speed_profile.json"}


def write_doc(out_dir: Path, doc: Path) -> list[str]:
    """Every part whose JSON is in `out_dir` into `doc`; returns the parts written."""
    done = []
    for part, name in JSON_NAMES.items():
        path = out_dir / name
        if path.exists():
            write_part(doc, HEADINGS[part], MARKDOWN[part](json.loads(path.read_text())))
            done.append(part)
    return done
