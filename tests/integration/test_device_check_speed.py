"""bench/device_check.sh end to end on CPU (DRY_RUN=1), the parts a lent GPU's
first minutes depend on: the speed sections (issue #49's run) pass and write
their JSON and doc rows, and the wheels for the GPU image are installed,
unpacked or refused with the sections needing them skipped and named.

    python -m pytest -q tests/integration/test_device_check_speed.py -m slow
"""

from __future__ import annotations

import json
import sys

import pytest
from device_check_run import load_bench, run_device_check, summary_line

gpu_speed = load_bench("gpu_speed")

@pytest.mark.slow
def test_speed_dry_run_passes(tmp_path):
    """Issue #49's device run (SECTIONS="env speed") on CPU: the kernels and the
    sweep under the interpreter (with the official kernel when
    bench/official_kernel.sh has copied it here), tiny train, profile and
    compiled parts; JSON and doc rows written, the doc regenerated from the JSON."""
    result = run_device_check(tmp_path, PYTHON=sys.executable, SECTIONS="env speed", DRY_RUN="1")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stdout[-3000:]
    for section in ("speed_kernels", "speed_sweep", "speed_train", "speed_profile", "speed_compiled"):
        assert " ok " in summary_line(tmp_path, section), summary
    out = tmp_path / "out"
    for part in ("kernels", "sweep", "train", "profile"):
        assert json.loads((out / f"speed_{part}.json").read_text())["dry_run"] is True
    train = json.loads((out / "speed_train.json").read_text())
    assert {(r["model"], r["mode"]) for r in train["results"]} == {
        (m, mode) for m in ("dense", "memplus fp32", "memplus bf16") for mode in ("eager", "compiled")}
    # The sweep's fastest, as config values of the Memory+ runs.
    assert train["launches"]["dense"] == [] and train["launches"]["memplus fp32"][0].startswith(
        "memory.triton_forward=[") and train["launches"]["memplus bf16"][1].startswith("memory.triton_backward=[")
    kernels_json = json.loads((out / "speed_kernels.json").read_text())
    assert {r["dtype"] for r in kernels_json["rows"]} == {"float32", "bfloat16"} and kernels_json["copy"]["gbs"] > 0
    assert {r["case"] for r in kernels_json["rows"]} == {"uniform", "L2-resident", "hot slots"}
    doc = (out / "benchmarks.md").read_text()
    section = doc.split("## GPU speed (bench/gpu_speed.py)", 1)[1]
    assert section.count("DRY RUN on CPU") == 4
    for name in ("segments", "by_slot", "atomic", "F.embedding_bag", "segments accumulate"):
        assert f"| {name}" in section, name
    again = tmp_path / "again.md"
    assert gpu_speed.main(["doc", str(out), "--doc", str(again)]) == 0
    assert again.read_text().split("## GPU speed (bench/gpu_speed.py)", 1)[1] == section


@pytest.mark.slow
def test_wheels_for_another_python_are_refused_and_the_sections_needing_them_skipped(tmp_path):
    """A GPU image without hydra, omegaconf and torchdata, and wheels built for
    another Python: each wheel is tried alone and named as refused, env still
    passes, every section needing the modules says SKIPPED and why, the
    summary names them, and the exit status is 3 (nothing failed, some skipped)."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    other = f"cp{sys.version_info[0]}{sys.version_info[1] + 1}"
    for name in ("hydra_core-1.3.8", "omegaconf-2.3.1", "torchdata-0.11.0"):
        (wheels / f"{name}-{other}-{other}-manylinux_2_17_x86_64.whl").write_bytes(b"")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nfor m in ('hydra', 'omegaconf', 'torchdata'):\n"
                                           "    sys.modules[m] = None  # the image lacks them\n")
    sections = "env mfu speed_train speed_profile speed_compiled"
    result = run_device_check(tmp_path, PYTHON=sys.executable, SECTIONS=sections, DRY_RUN="1", WHEELS=str(wheels),
                  PYTHONPATH=str(site))
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 3, summary + result.stdout[-3000:]
    version = ".".join(map(str, sys.version_info[:3]))
    assert f"Python {version}" in result.stdout
    assert result.stdout.count(f"wheel REFUSED on Python {version}: ") == 3 and "not a supported wheel" in result.stdout
    assert " ok " in summary_line(tmp_path, "env")
    assert "training modules missing: hydra omegaconf torchdata" in summary_line(tmp_path, "env")
    for section in sections.split()[1:]:
        line = summary_line(tmp_path, section)
        assert "SKIPPED" in line and f"needs hydra omegaconf torchdata: not importable on Python {version}" in line
        assert "wheels refused: hydra_core-1.3.8-" in line, line
    assert "skipped sections: 4: mfu speed_train speed_profile speed_compiled" in summary
    assert "failed sections: 0" in summary


@pytest.mark.slow
def test_without_pip_pure_wheels_are_unpacked(tmp_path):
    """A Python without pip: a pure-Python wheel is unpacked into the site
    folder, a binary one is refused and named."""
    import zipfile

    wheels = tmp_path / "whl"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fakemod-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("fakemod/__init__.py", "WHERE = __file__\n")
    (wheels / "fakebin-1.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\n"
                      'if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ]; then\n'
                      '    echo "No module named pip" >&2; exit 1\nfi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    run_device_check(tmp_path, PYTHON=str(python), SECTIONS="env", DRY_RUN="1", WHEELS=str(wheels))
    log = (tmp_path / "out" / "wheels.log").read_text()
    assert f"wheel installed (unpacked: {python} has no pip): fakemod-1.0-py3-none-any.whl" in log, log
    assert "wheel REFUSED on Python" in log and "fakebin-1.0-cp312" in log and "not a pure-Python wheel" in log
