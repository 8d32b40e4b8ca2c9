"""The ablation report: tables and goal checks come from the run folders, the doc keeps its prose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memlm.config.run import compose, to_yaml
from memlm.studies.ablation_report import BEGIN, END, main

VARIANTS = ["ablation_dense", "ablation_moe", "ablation_peer", "ablation_memory", "ablation_memplus"]


def _fake_run(dump: Path, overrides: list[str], em_seen: float, val_loss: float, usage: float | None) -> None:
    (dump / "evals").mkdir(parents=True)
    (dump / "config.yaml").write_text(to_yaml(compose(overrides)))  # what the trainer saves
    (dump / "summary.json").write_text(json.dumps({"tokens": 8192000, "seconds": 600.0, "final_loss": 0.9,
                                                   "val_loss": val_loss}))
    results = {"synthetic_qa_seen": {"exact_match": em_seen, "n": 1000, "phrasings_em50": 2 * em_seen},
               "synthetic_qa_unseen": {"exact_match": em_seen / 4, "n": 1000},
               "synthetic_qa_trained": {"exact_match": em_seen * 3, "n": 1000}}
    (dump / "evals" / "2000.json").write_text(json.dumps({"step": 2000, "results": results}))
    last = {"step": 2000, **({"memory/layer2/usage": usage} if usage is not None else {})}
    lines = [{"step": 1}, last, {"step": 2000, "val_loss": val_loss}]  # the last line has no usage
    (dump / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _fake_sweep(root: Path, points: list[tuple[str, list[str], float, float, float | None]]) -> None:
    record = []
    for label, overrides, em, loss, usage in points:
        _fake_run(root / label, overrides, em, loss, usage)
        record.append({"point": label, "dump_dir": str(root / label), "status": "ok",
                       "overrides": [*overrides, f"dump_dir={root / label}", f"name=x/{label}"]})
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps(record))


@pytest.fixture
def roots(tmp_path):
    ems = {"ablation_dense": 0.10, "ablation_moe": 0.11, "ablation_peer": 0.12, "ablation_memory": 0.14,
           "ablation_memplus": 0.20}
    _fake_sweep(tmp_path / "ab", [(f"experiment={v}", [f"experiment={v}"], ems[v], 1.0 - ems[v],
                                   None if v in ("ablation_dense", "ablation_moe") else 0.9) for v in VARIANTS])
    sizes = {32: 0.12, 64: 0.15, 256: 0.19}  # with the ablation's Memory+ (128: 0.20) not rising
    _fake_sweep(tmp_path / "sw", [(f"memory.n_keys={n}", ["experiment=ablation_memplus", f"memory.n_keys={n}"],
                                   em, 1.0 - em, 0.8) for n, em in sizes.items()])
    # A second sweep root stopped before it wrote sweep.json: its finished runs still count.
    _fake_sweep(tmp_path / "sw2", [("memory.n_keys=48", ["experiment=ablation_memplus", "memory.n_keys=48"],
                                    0.16, 0.84, 0.8)])
    (tmp_path / "sw2" / "sweep.json").unlink()
    # A point of another sweep command into the same root (whose sweep.json the last one rewrote).
    _fake_run(tmp_path / "sw" / "memory.n_keys=40", ["experiment=ablation_memplus", "memory.n_keys=40"], 0.10, 0.9, 0.8)
    return tmp_path


def test_report_tables_goals_and_plot(roots, capsys):
    doc = roots / "results.md"
    doc.write_text(f"# Results\n\nProse before.\n\n{BEGIN}\nold table\n{END}\n\nProse after.\n")
    args = [str(roots / "ab"), str(roots / "sw"), str(roots / "sw2"), "--doc", str(doc), "--plot", str(roots / "s.png")]
    assert main(args) == 0
    text = doc.read_text()
    assert "Prose before." in text and "Prose after." in text and "old table" not in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"Dense", "MoE", "PEER", "Memory", "Memory+"}
    cells = [c.strip() for c in rows["Memory+"].split("|")[1:-1]]
    assert cells[4:9] == ["8,192,000", "20.0", "5.0", "60.0", "0.9000"] and cells[11] == "90.0"
    assert [c.strip() for c in rows["Dense"].split("|")[1:-1]][11] == "-"  # no memory, no usage
    assert "Memory+ EM >= 1.5x Dense (seen people): 20.0% vs 10.0% = 2.00x: met" in text
    assert "Memory+ above Memory: 20.0% vs 14.0%: met" in text
    assert ("EM rising with memory size across the sweep: "
            "12.0% -> 10.0% -> 16.0% -> 15.0% -> 20.0% -> 19.0%: NOT met") in text
    assert "within 10% across variants" in text
    assert "| Memory+ 16,384 slots (1,048,576 params) |" in text  # the ablation's Memory+ joins the sweep
    assert (roots / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_sweep_and_markers_are_clear_errors(roots, capsys):
    # A ReportError exits 1 from every study report (it was 2 here only; docs/errors.md).
    assert main([str(roots / "nope"), "--plot", ""]) == 1
    assert "sweep.json not found and no finished runs" in capsys.readouterr().err
    doc = roots / "plain.md"
    doc.write_text("# Results without markers\n")
    assert main([str(roots / "ab"), "--doc", str(doc), "--plot", ""]) == 1
    assert "lacks the markers" in capsys.readouterr().err


def test_replicates_pool_into_means_and_runs_table(roots, capsys):
    # Seed-1 runs of Dense and of the 256^2 sweep point, a byte-identical rerun of seed-0 Memory+
    # (not another draw: counted once) and a run of a config the study does not have.
    rep = roots / "rep"
    _fake_sweep(rep, [
        ("experiment=ablation_dense", ["experiment=ablation_dense", "seed=1", "data.seed=1"], 0.20, 0.90, None),
        ("memory.n_keys=256", ["experiment=ablation_memplus", "memory.n_keys=256", "seed=1"], 0.29, 0.70, 0.8),
        ("experiment=ablation_memplus", ["experiment=ablation_memplus"], 0.20, 0.80, 0.9),
        ("other", ["experiment=ablation_memplus", "memory.knn=8"], 0.5, 0.5, 0.9),
    ])
    doc = roots / "results.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    args = [str(roots / "ab"), str(roots / "sw"), "--replicates", str(rep), "--doc", str(doc), "--plot", ""]
    assert main(args) == 0
    text, err = doc.read_text(), capsys.readouterr().err
    assert "means over the independent runs" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in text.split("### Runs")[0].splitlines() if line.startswith("| ")}
    assert rows["Dense"][5] == "15.0" and rows["Dense"][-1] == "2"  # mean of 10% and 20%
    assert rows["Memory+"][5] == "20.0" and rows["Memory+"][-1] == "1"  # the identical rerun is not a new run
    assert rows["MoE"][-1] == "1"
    big = rows["Memory+ 65,536 slots (4,194,304 params)"]
    assert big[5] == "24.0" and big[9] == "0.7550" and big[-1] == "2"  # EM (19+29)/2, val loss (0.81+0.70)/2
    assert "Memory+ EM >= 1.5x Dense (seen people): 20.0% vs 15.0% = 1.33x: NOT met" in text
    runs = text.split("### Runs")[1]
    # EM seen, spread, EM trained (3x seen in the fakes), held-out phrasings answered (2x), val loss per run
    assert "| Dense | 0,0 / 1,1 | 10.0 / 20.0 | 10.0 | 30.0 / 60.0 | 20.0 / 40.0 | 0.9000 / 0.9000 |" in runs
    assert "| Memory+ 65,536 slots (4,194,304 params) | 0,0 / 1,0 | 19.0 / 29.0 | 10.0 |" in runs
    assert "ignored" in err and "other" in err and err.count("ignored") == 1


def test_config_key_ignores_only_run_identity():
    from memlm.studies.replicates import run_identity

    def key(*overrides):
        return run_identity(to_yaml(compose(["experiment=ablation_memplus", *overrides])))[0]

    base = key()
    assert key("seed=3", "data.seed=2", "dump_dir=/x", "name=y", "data.cache_dir=/c") == base
    assert key("memory.knn=8") != base and key("data.synthetic.seed=1") != base and key("steps=10") != base


def test_config_key_of_a_run_saved_before_a_field_existed():
    # A run saved before memory.value_init_scale existed used the published
    # init (1.0): the same config as a run saved with the field at its default.
    from memlm.studies.replicates import run_identity

    saved = yaml.safe_load(to_yaml(compose(["experiment=ablation_memplus"])))
    older = {**saved, "memory": {k: v for k, v in saved["memory"].items() if k != "value_init_scale"}}
    assert run_identity(yaml.safe_dump(older))[0] == run_identity(yaml.safe_dump(saved))[0]
    changed = {**saved, "memory": {**saved["memory"], "value_init_scale": 0.1}}
    assert run_identity(yaml.safe_dump(changed))[0] != run_identity(yaml.safe_dump(saved))[0]
    removed = {**saved, "no_longer_a_field": 1}  # unreadable by the schema: hashed as saved
    assert run_identity(yaml.safe_dump(removed))[0] != run_identity(yaml.safe_dump(saved))[0]


def test_optional_three_layer_row_gets_its_own_goals(roots):
    _fake_run(roots / "ab" / "experiment=ablation_memplus3", ["experiment=ablation_memplus3"], 0.16, 0.8, 0.9)
    doc = roots / "results.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    assert main([str(roots / "ab"), "--doc", str(doc), "--plot", ""]) == 0
    text = doc.read_text()
    assert "| Memory+ (3 layers) |" in text and "| Memory+ |" in text  # not confused with each other
    assert "Memory+ (3 layers) EM >= 1.5x Dense (seen people): 16.0% vs 10.0% = 1.60x: met" in text
    assert "Memory+ (3 layers) above Memory: 16.0% vs 14.0%: met" in text
    assert "Memory+ (3 layers) at or above MoE (11.0%) and PEER (12.0%): met" in text
    assert "Memory+ EM >= 1.5x Dense (seen people): 20.0% vs 10.0% = 2.00x: met" in text


def test_levers_are_paired_with_the_study_run_of_the_same_seeds(roots):
    # value_lr 0.03 on Memory+ at seeds (0,0) -- the study has that run: 20% -- and (1,0) -- it has none;
    # qk_norm off on the sweep's 256^2 point at seed (0,0) (study: 19%).
    lev = roots / "lev"
    _fake_sweep(lev, [
        ("a", ["experiment=ablation_memplus", "memory.value_lr=0.03"], 0.30, 0.70, 0.9),
        ("b", ["experiment=ablation_memplus", "memory.value_lr=0.03", "seed=1"], 0.40, 0.60, 0.9),
        ("c", ["experiment=ablation_memplus", "memory.n_keys=256", "memory.qk_norm=false"], 0.09, 0.95, 0.9),
        # As few changes from PEER's config (kind, k_dim) as from Memory+'s: it is a Memory+ lever.
        ("d", ["experiment=ablation_memplus", "memory.knn=16", "memory.eval_knn=16"], 0.2, 0.9, 0.9),
    ])
    doc = roots / "results.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    assert main([str(roots / "ab"), str(roots / "sw"), "--levers", str(lev), "--doc", str(doc), "--plot", ""]) == 0
    levers = doc.read_text().split("### Levers")[1]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in levers.splitlines() if line.startswith("| memory.")]
    # Grouped by variant in the ablation's order, the 16K Memory+ before the sweep's 64K, then by change.
    assert [row[:2] for row in rows] == [["memory.eval_knn=16 memory.knn=16", "Memory+ 16,384 slots"],
                                         ["memory.value_lr=0.03", "Memory+ 16,384 slots"],
                                         ["memory.qk_norm=false", "Memory+ 65,536 slots"]]
    assert rows[1][2:5] == ["0,0 / 1,0", "30.0 (20.0) / 40.0 (-)", "+10.0"]
    assert rows[1][6] == "+30.0"  # trained EM is 3x seen in the fake runs: 90 vs 60
    assert rows[1][7] == "60.0 (40.0) / 80.0 (-)"  # held-out phrasings answered: 2x seen in the fakes
    assert rows[2][2:5] == ["0,0", "9.0 (19.0)", "-10.0"]
    assert rows[0][2:5] == ["0,0", "20.0 (20.0)", "+0.0"]


def test_each_variant_at_its_best_tried_config(roots):
    # Dense: lr 6e-3 gains 3 points, lr 1e-3 loses 2, twice the steps (other tokens) is not a tuning
    # change; MoE: its one lever loses (the study config stays best); the others: no levers.
    lev = roots / "lev"
    _fake_sweep(lev, [
        ("a", ["experiment=ablation_dense", "optim.lr=0.006"], 0.13, 0.8, None),
        ("b", ["experiment=ablation_dense", "optim.lr=0.001"], 0.08, 0.8, None),
        ("c", ["experiment=ablation_dense", "steps=4000"], 0.50, 0.5, None),
        ("d", ["experiment=ablation_moe", "optim.lr=0.006"], 0.09, 0.9, None),
    ])
    summary = json.loads((lev / "c" / "summary.json").read_text())
    (lev / "c" / "summary.json").write_text(json.dumps({**summary, "tokens": 2 * summary["tokens"]}))
    doc = roots / "results.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    assert main([str(roots / "ab"), "--levers", str(lev), "--doc", str(doc), "--plot", ""]) == 0
    tuned = doc.read_text().split("### Each variant at its best tried config")[1].split("### Learning rate")[0]
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in tuned.splitlines()
                              if line.startswith("| ") and not line.startswith("| variant"))}
    assert rows["Dense"] == ["Dense", "2", "optim.lr=0.006", "0,0", "+3.0", "10.0", "13.0"]
    assert rows["MoE"] == ["MoE", "1", "the study config", "-", "+0.0", "11.0", "11.0"]
    assert rows["PEER"] == ["PEER", "0", "the study config", "-", "-", "12.0", "12.0"]
    assert "Memory+ EM >= 1.5x Dense (seen people): 20.0% vs 13.0% = 1.54x: met" in tuned
    assert "Memory+ at or above MoE (11.0%) and PEER (12.0%): met" in tuned
    assert "EM rising" not in tuned  # the sweep is not re-judged on tuned figures


def test_learning_rate_grid_counts_the_configs_tried_at_each_rate(roots):
    # Dense: lr 6e-3 and 1e-3; Memory+: a smaller value init at the study's lr (two configs at 3e-3, the
    # better one shown) and with lr 6e-3; a longer run is another budget and stays out of the grid.
    lev = roots / "lev"
    _fake_sweep(lev, [
        ("a", ["experiment=ablation_dense", "optim.lr=0.006"], 0.13, 0.8, None),
        ("b", ["experiment=ablation_dense", "optim.lr=0.001"], 0.08, 0.8, None),
        ("c", ["experiment=ablation_memplus", "memory.value_init_scale=0.1"], 0.25, 0.7, 0.9),
        ("d", ["experiment=ablation_memplus", "memory.value_init_scale=0.1", "optim.lr=0.006"], 0.22, 0.7, 0.9),
        ("e", ["experiment=ablation_memplus", "steps=4000", "optim.lr=0.001"], 0.50, 0.5, 0.9),
    ])
    summary = json.loads((lev / "e" / "summary.json").read_text())
    (lev / "e" / "summary.json").write_text(json.dumps({**summary, "tokens": 2 * summary["tokens"]}))
    doc = roots / "results.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    assert main([str(roots / "ab"), "--levers", str(lev), "--doc", str(doc), "--plot", ""]) == 0
    grid = doc.read_text().split("### Learning rate, the lever every variant has")[1]
    lines = [[c.strip() for c in line.split("|")[1:-1]] for line in grid.splitlines() if line.startswith("| ")]
    assert lines[0] == ["variant", "lr 0.001", "lr 0.003", "lr 0.006"]
    rows = {cells[0]: cells[1:] for cells in lines[1:]}
    assert rows["Dense"] == ["8.0 (1)", "10.0 (1)", "13.0 (1)"]
    assert rows["Memory+"] == ["-", "25.0 (2)", "22.0 (1)"]
    assert rows["PEER"] == ["-", "12.0 (1)", "-"]
