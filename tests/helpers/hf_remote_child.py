"""A memlm export loaded by plain transformers (AutoModelForCausalLM, trust_remote_code)
in a child process where `import memlm` is blocked, checked against memlm's own model:
logits equal (or within `tol`, for MoE's other summation order), greedy generation
equal, and beam search with the KV cache equal to beam search without it
(tests/integration/test_hf_remote.py, test_hf_import.py's retrofit)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Where the modeling file cannot sum in memlm's order: MoE's per-expert loop against
# memlm's grouped GEMM, and the KV cache or a padded batch against a full recompute.
TOL = 1e-5

CHILD = r"""
import importlib.abc, importlib.util, sys
memlm_installed = importlib.util.find_spec("memlm") is not None

class BlockMemlm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "memlm":
            raise ModuleNotFoundError(f"memlm is blocked in this check ({name})")

sys.meta_path.insert(0, BlockMemlm())
import torch, transformers
from safetensors.torch import load_file, save_file
bundle, io = sys.argv[1], sys.argv[2]
tokens = load_file(io + "/in.safetensors")["tokens"]
model = transformers.AutoModelForCausalLM.from_pretrained(bundle, trust_remote_code=True)
with torch.no_grad():
    logits = model(tokens).logits
generated = model.generate(tokens[:, :4], attention_mask=torch.ones_like(tokens[:, :4]), max_new_tokens=6,
                           do_sample=False, pad_token_id=0)
beams = {f"beams_{use}": model.generate(tokens[:, :4], attention_mask=torch.ones_like(tokens[:, :4]),
                                        max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0,
                                        use_cache=use == "cached").contiguous() for use in ("cached", "whole")}
assert not [m for m in sys.modules if m.split(".")[0] == "memlm"], "memlm was imported"
save_file({"logits": logits.contiguous(), "generated": generated, **beams}, io + "/out.safetensors")
print("memlm installed:", memlm_installed, "| transformers", transformers.__version__, "| torch", torch.__version__)
"""


def run_remote_child(python: str, isolated: bool, export_dir: Path, ours, tmp: Path, tol: float = 0.0) -> str:
    io = tmp / f"io_{'isolated' if isolated else 'venv'}"
    io.mkdir(exist_ok=True)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens}, str(io / "in.safetensors"))
    # No PYTHONPATH (it points at memlm), remote modules cached in the test's folder.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp / "hf_modules")
    cmd = [python, *(["-I"] if isolated else []), "-c", CHILD, str(export_dir), str(io)]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = load_file(str(io / "out.safetensors"))
    with torch.no_grad():
        diff = (out["logits"] - ours(tokens)).abs().max().item()
        assert diff == 0.0 if tol == 0.0 else diff <= tol, f"max |logit difference| {diff}"
        expected = tokens[:, :4]
        for _ in range(6):
            expected = torch.cat([expected, ours(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out["generated"], expected)
    assert torch.equal(out["beams_cached"], out["beams_whole"])  # beam search reorders the whole cache
    return proc.stdout
