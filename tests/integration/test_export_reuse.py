"""What a user does next with an export: read it with transformers, start a new run from it.

Every FFN kind (dense, Memory, Memory+, MoE, PEER) is trained for a few steps
and exported once (module fixture), then:
- the tokenizer loads with the line docs/checkpoints.md shows, in a child
  process with stdin closed: no remote-code question (transformers 5 asks one
  for any folder whose config.json needs custom code, and waits 15 s for the
  answer at a terminal), memlm's ids; under transformers 4.x too when
  MEMLM_TF4_PYTHON names its interpreter (`make test-tf4`);
- the documented snippet (tokenizer, model, generate) runs as written on every
  export and prints memlm's greedy answer;
- `init_from=<export>` and `init_from=hf:<export>` start a run whose weights
  are the export's, bitwise, and whose first loss equals that of a run started
  from the checkpoint the export was made of; a run whose config differs gets
  one line naming every difference and the overrides that fix it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from memlm.config.run import compose  # noqa: E402
from memlm.data.tokenizer import Tokenizer  # noqa: E402
from memlm.errors import ConfigError  # noqa: E402
from memlm.generation.decoding import greedy_generate, prompt_ids  # noqa: E402
from memlm.hf import from_pretrained  # noqa: E402
from memlm.run.export import export  # noqa: E402
from memlm.run.load import resolve_checkpoint_dir  # noqa: E402
from memlm.train.preflight import check_init_from  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402


def composed(overrides):
    """compose + the check of init_from a run makes before it starts (memlm.train.preflight)."""
    cfg = compose(overrides)
    check_init_from(cfg)
    return cfg

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
DOCS = HELPERS.parents[1] / "docs" / "checkpoints.md"
RUN = ["data=synthetic", "data.synthetic.people=20", "data.seq_len=32", "data.micro_batch=2",
       "model.vocab_size=512", "model.max_seq_len=128", "logging.wandb.mode=disabled", "optim.lr=3e-3",
       "optim.warmup=0"]
PKM = ["memory.layers=[1]", "memory.n_keys=8", "memory.knn=4", "memory.heads=2", "memory.k_dim=16"]
KINDS = {
    "dense": [],
    "memory": ["model.n_layers=3", "memory=pk", *PKM, "memory.eval_knn=4"],
    "memplus": ["model.n_layers=3", "memory=memplus", *PKM, "memory.eval_knn=4"],
    "moe": ["model.n_layers=3", "memory=moe", "memory.layers=[1]", "memory.n_experts=4", "memory.top_k=2"],
    "peer": ["model.n_layers=3", "memory=peer", *PKM],
}
TEXTS = ["", " ", "Hello world", "  two leading spaces", "Q: Where was Anna born?\nA:", "héllo 日本 🙂", "</s> as text"]
PROMPT_WORDS = ("custom code", "trust_remote_code")  # what transformers' remote-code question says
TF4 = os.environ.get("MEMLM_TF4_PYTHON")
PYTHONS = [pytest.param(sys.executable, id="transformers5"),
           pytest.param(TF4, id="transformers4",
                        marks=pytest.mark.skipif(not TF4, reason="MEMLM_TF4_PYTHON unset: the interpreter of a "
                                                 "venv with transformers 4.x (make test-tf4)"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[str], Path, Path]]:
    """kind -> (the run's overrides, its dump_dir, its export), 3 training steps each."""
    cache = tmp_path_factory.mktemp("corpus")  # one synthetic corpus and tokenizer for every run
    out = {}
    for kind, extra in KINDS.items():
        root = tmp_path_factory.mktemp(kind)
        overrides = [*RUN, *extra, f"data.cache_dir={cache}"]
        Trainer(composed([*overrides, "steps=3", f"dump_dir={root / 'run'}"])).fit()
        out[kind] = (overrides, root / "run", export(root / "run", root / "export"))
    return out


def _child(python: str, code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with stdin closed, offline, without memlm on its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "hf_modules"))
    proc = subprocess.run([python, "-c", code, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    asked = [w for w in PROMPT_WORDS if w in proc.stdout + proc.stderr]
    assert not asked, f"transformers asked about remote code: {(proc.stdout + proc.stderr)[-1500:]}"
    return proc


# ---------------------------------------------------------------- tokenizer
TOKENIZER_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from hf_bundle_checker import check  # the documented AutoTokenizer line
result = {}
for export_dir in sys.argv[3:]:
    start = time.monotonic()
    result[export_dir] = check(export_dir, json.loads(sys.argv[2]))
    result[export_dir]["seconds"] = time.monotonic() - start
print(json.dumps(result))
"""


@pytest.mark.parametrize("python", PYTHONS)
def test_tokenizer_loads_without_remote_code_or_a_question(runs, python, tmp_path):
    exports = {kind: str(runs[kind][2]) for kind in KINDS}
    proc = _child(python, TOKENIZER_CHILD, str(HELPERS), json.dumps({"texts": TEXTS}), *exports.values(), cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind, export_dir in exports.items():
        got, tok = result[export_dir], Tokenizer(str(Path(export_dir) / "tokenizer.model"))
        assert got["seconds"] < 10, f"{kind}: the tokenizer took {got['seconds']:.1f} s to load"
        assert got["plain"] == [tok.encode(t) for t in TEXTS], kind
        assert got["with_special"] == [prompt_ids(tok, t) for t in TEXTS], kind  # eos first, as memlm prompts
        assert got["special"] == {"bos": tok.eos_id, "eos": tok.eos_id, "pad": tok.pad_id}, kind


def _documented_snippet() -> str:
    text = DOCS.read_text()
    section = text[text.index("### The export in plain transformers code"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


SNIPPET_CHILD = """
import json, os, sys


code = open(sys.argv[1]).read()
for folder in sys.argv[2:]:  # each holds exports/try1, the path the snippet names
    os.chdir(folder)
    ns = {"__name__": "__main__"}
    exec(compile(code, "docs/checkpoints.md", "exec"), ns)  # prints the answer
    new = ns["out"][0, ns["enc"].input_ids.shape[1]:].tolist()
    print("new tokens", json.dumps(new[:-1] if new and new[-1] == ns["tok"].eos_token_id else new), flush=True)
"""


@pytest.mark.parametrize("python", PYTHONS)
def test_the_documented_lines_run_on_every_export(runs, python, tmp_path):
    snippet = _documented_snippet()
    assert 'AutoTokenizer.from_pretrained("exports/try1")' not in snippet  # transformers 5 would ask
    (tmp_path / "snippet.py").write_text(snippet)
    prompt = re.search(r'tok\("(.*?)", return_tensors', snippet).group(1).encode().decode("unicode_escape")
    max_new = int(re.search(r"max_new_tokens=(\d+)", snippet).group(1))
    folders, expected = [], []
    for kind in KINDS:
        folder = tmp_path / kind
        (folder / "exports").mkdir(parents=True)
        (folder / "exports" / "try1").symlink_to(runs[kind][2])
        folders.append(str(folder))
        tok = Tokenizer(str(runs[kind][2] / "tokenizer.model"))
        tokens, _ = greedy_generate(from_pretrained(runs[kind][2]), [prompt_ids(tok, prompt)], max_new, tok.eos_id)
        expected.append(tokens[0])  # memlm's greedy answer, without the eos
    proc = _child(python, SNIPPET_CHILD, str(tmp_path / "snippet.py"), *folders, cwd=tmp_path)
    lines = proc.stdout.splitlines()
    got = [json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith("new tokens ")]
    assert got == expected
    assert len(lines) >= 2 * len(KINDS)  # and the snippet printed each answer


# ---------------------------------------------------------------- init_from
def _batches(n: int = 2):
    tokens = torch.randint(0, 512, (n, 2, 33), generator=torch.Generator().manual_seed(7))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _start(overrides: list[str], init_from: str, dump_dir: Path) -> tuple[dict[str, torch.Tensor], float]:
    """The weights a run starts with, and its first training loss."""
    t = Trainer(composed([*overrides, "steps=2", f"init_from={init_from}", f"dump_dir={dump_dir}"]),
                train_loader=iter(_batches()))
    state = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    loss = t.train_step()["loss"]
    t.close()
    return state, loss


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_run_starts_from_an_export_as_from_its_checkpoint(runs, kind, tmp_path, capsys):
    overrides, run_dir, export_dir = runs[kind]
    exported = from_pretrained(export_dir).state_dict()
    reference, ref_loss = _start(overrides, str(resolve_checkpoint_dir(run_dir)), tmp_path / "from_checkpoint")
    assert set(reference) == set(exported)
    for init_from in (str(export_dir), f"hf:{export_dir}"):
        state, loss = _start(overrides, init_from, tmp_path / init_from.replace("/", "_"))
        for key, value in exported.items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), (init_from, key)
            assert torch.equal(state[key], reference[key]), (init_from, key)
        assert loss == ref_loss, init_from
    out = capsys.readouterr().out
    as_export = out.count(f"[init] initialized from the export {export_dir} (step 3): all {len(exported)} tensors")
    if kind == "dense":  # hf:<dense export> is imported as the Llama it is
        assert as_export == 1 and (f"[hf-import] initialized from {export_dir}: "
                                   f"kept {len(exported)} tensors, 0 new") in out
    else:
        assert as_export == 2


def test_a_mismatched_run_is_refused_with_every_difference_and_the_fix(runs):
    overrides, _, export_dir = runs["memplus"]
    for init_from in (str(export_dir), f"hf:{export_dir}"):
        with pytest.raises(ConfigError) as err:
            composed([*overrides, "memory.n_keys=16", "memory.gate=sigmoid", "model.rope_theta=500000.0",
                     f"init_from={init_from}"])
        msg = str(err.value)
        assert "\n" not in msg
        assert f"invalid config value init_from={init_from!r}: an export of the run's model; " in msg
        assert f"{export_dir / 'memlm_config.json'} differs in 3 value(s): " in msg
        assert "model.rope_theta=500000.0 but the export's is 10000.0" in msg
        assert ("memory.n_keys=16 but the export's is 8" in msg
                and "memory.gate=sigmoid but the export's is swilu" in msg)
        fix = "Run with the export's values: model.rope_theta=10000.0 memory.n_keys=8 memory.gate=swilu"
        assert msg.endswith(fix)
        composed([*overrides, "memory.n_keys=16", "memory.gate=sigmoid", "model.rope_theta=500000.0",
                 *fix.split(": ")[1].split(), f"init_from={init_from}"])  # the printed fix is a valid config
    # knn / eval_knn hold no weights: a run may change them
    composed([*overrides, "memory.knn=2", "memory.eval_knn=2", f"init_from={export_dir}"])


def test_a_run_without_the_exports_memory_gets_the_whole_fix(runs):
    overrides, _, export_dir = runs["memplus"]
    dense = [o for o in overrides if not o.startswith("memory") and o != "model.n_layers=3"]
    with pytest.raises(ConfigError) as err:
        composed([*dense, f"init_from={export_dir}"])
    fix = str(err.value).split("Run with the export's values: ")[1]
    assert fix.startswith("model.n_layers=3 memory.kind=memplus memory.layers=[1] memory.n_keys=8"), fix
    composed([*dense, *fix.split(), f"init_from={export_dir}"])


def test_a_dense_export_takes_memory_layers_only_as_a_llama(runs):
    overrides, _, export_dir = runs["dense"]
    memory = ["model.n_layers=2", "memory=memplus", *PKM, "memory.eval_knn=4"]
    with pytest.raises(ConfigError, match=r"memory.kind=memplus but the export's is none.*"
                       rf"\(or init_from=hf:{re.escape(str(export_dir))}: a dense export is also a Llama"):
        composed([*overrides, *memory, f"init_from={export_dir}"])
    composed([*overrides, *memory, f"init_from=hf:{export_dir}"])  # the Llama import: memory layers new


def test_a_broken_export_is_named(runs, tmp_path):
    overrides, _, export_dir = runs["moe"]
    broken = tmp_path / "broken"
    shutil.copytree(export_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=rf"a memlm export .*weight file {re.escape(str(broken))}/model.safetensors "
                       "is missing"):
        composed([*overrides, f"init_from={broken}"])
    (broken / "memlm_config.json").write_text("{not json")
    # The reader's own line (memlm.hf.pretrained, the same from memlm.evals and memlm.generate), under init_from.
    with pytest.raises(ConfigError, match=r"init_from=.*memlm_config.json is not readable JSON"):
        composed([*overrides, f"init_from=hf:{broken}"])


@pytest.mark.slow
def test_two_ranks_with_split_value_tables_load_the_export(runs, tmp_path):
    """2 gloo ranks, parallel.memory_parallel=2: the value table is split by columns over the ranks; each gets
    its columns of the export's table, and the loss is one process's on the same rows."""
    from distributed_workers import run_ranks
    from hf_import_workers import import_and_step

    overrides, _, export_dir = runs["memplus"]
    tokens = torch.randint(0, 512, (1, 4, 33), generator=torch.Generator().manual_seed(3))
    torch.save([(t[:, :-1], t[:, 1:]) for t in tokens], tmp_path / "batches.pt")
    run_ranks(import_and_step, 2, [*overrides, "parallel.memory_parallel=2", f"init_from={export_dir}",
                                   f"dump_dir={tmp_path / 'run'}"],
              str(tmp_path / "batches.pt"), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    exported = from_pretrained(export_dir).state_dict()
    assert set(out["state"]) == set(exported)
    assert all(torch.equal(out["state"][k], v) for k, v in exported.items())
    single = Trainer(composed([*overrides, "data.micro_batch=4", f"init_from={export_dir}",
                              f"dump_dir={tmp_path / 'one'}"]),
                     train_loader=iter([(tokens[0][:, :-1], tokens[0][:, 1:])]))
    ref = single.train_step()["loss"]
    single.close()
    assert out["loss"] == pytest.approx(ref, abs=1e-5)
