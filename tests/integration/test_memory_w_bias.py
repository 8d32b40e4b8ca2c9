"""memory.w_bias (Memory+'s W1/W2 biases) through a run: checkpoint, resume, both export kinds.

- a run with the switch on saves the biases, resumes from the checkpoint and
  continues bit for bit (losses `==`, every weight equal at the end);
- its export carries them in both kinds of bundle: the memlm layout
  (memlm_config.json, read by memlm.hf.from_pretrained) and the
  trust_remote_code one (config.json `memory.w_bias`, read by transformers),
  whose logits equal memlm's exactly (0.0, float32 on CPU);
- with the switch off, neither the checkpoint nor the export has a W1/W2 bias
  tensor, and config.json has no `w_bias` key (what it was before the switch);
- a run started from a biased export without the switch is refused at compose,
  naming memory.w_bias and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_workers import full_state

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.hf import from_pretrained
from memlm.run.export import export
from memlm.train.preflight import check_init_from
from memlm.train.trainer import Trainer

RUN = ["model.vocab_size=128", "model.n_layers=3", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=2",
       "optim.lr=3e-3", "logging.every=1", "logging.wandb.mode=disabled", "memory=memplus", "memory.layers=[1]",
       "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16"]
BIASES = ("layers.1.feed_forward.memory.w1.bias", "layers.1.feed_forward.memory.w2.bias")


def _losses(dump_dir: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _restored(dump_dir: Path, overrides: list[str]) -> dict[str, torch.Tensor]:
    """The run's newest checkpoint, restored by a trainer that takes no step."""
    return full_state(Trainer(compose([*overrides, f"dump_dir={dump_dir}", "resume=auto", "steps=0"])).model)


def test_a_biased_run_saves_and_resumes_exactly(tmp_path):
    run = [*RUN, "memory.w_bias=true", "steps=4", "checkpoint.every=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(compose([*run, f"dump_dir={full}"])).fit()
    Trainer(compose([*run, "checkpoint.at_end=false", f"dump_dir={part}"])).fit(2)  # stops after step 2
    Trainer(compose([*run, f"dump_dir={part}", "resume=auto"])).fit()
    a, b = _losses(full), _losses(part)
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]  # bitwise
    wa, wb = _restored(full, run), _restored(part, run)
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    for name in BIASES:  # in the checkpoint, and trained away from their zero init
        assert float(wa[name].abs().max()) > 0, name


@pytest.mark.parametrize("w_bias", [False, True], ids=["off", "on"])
def test_both_export_kinds_carry_the_biases_only_when_on(tmp_path, w_bias):
    transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")
    from safetensors import safe_open

    switch = f"memory.w_bias={str(w_bias).lower()}"
    trainer = Trainer(compose([*RUN, switch, "steps=2", f"dump_dir={tmp_path / 'run'}"]))
    trainer.fit()
    ours = trainer.model.eval()
    out = export(tmp_path / "run", tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {n for n in names if n.endswith((".w1.bias", ".w2.bias"))} == (set(BIASES) if w_bias else set())
    assert json.loads((out / "memlm_config.json").read_text())["memory"]["w_bias"] is w_bias
    remote_memory = json.loads((out / "config.json").read_text())["memory"]
    assert remote_memory.get("w_bias", "absent") == (True if w_bias else "absent")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert set(hf.state_dict()) == names
    with torch.no_grad():
        logits = ours(tokens)
        assert torch.equal(from_pretrained(out)(tokens), logits)  # the memlm layout
        diff = (hf(tokens).logits - logits).abs().max().item()  # the trust_remote_code bundle
    assert diff == 0.0, f"max |memlm - transformers| logit {diff}"
    if w_bias:  # init_from=<the export>: the switch is part of the model, the run must set it
        with pytest.raises(ConfigError) as err:
            check_init_from(compose([*RUN, f"init_from={out}"]))  # what a run checks before it starts
        assert "memory.w_bias=false but the export's is true" in str(err.value)
        assert str(err.value).endswith("Run with the export's values: memory.w_bias=true")
        check_init_from(compose([*RUN, "memory.w_bias=true", f"init_from={out}"]))
