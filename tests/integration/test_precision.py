"""Mixed precision (memlm.distributed.precision): parallel.dtype=bf16 computes in
bf16 on one process too, the product-key scores, top-k and softmax stay
float32, weights and optimizer state stay float32, and memory.value_dtype=bf16
stores the value table in bf16 with float32 optimizer moments."""

from __future__ import annotations

import pytest
import torch
from distributed_workers import run_ranks
from torch import nn

import memlm.memory.fast.search_grad as search_grad
import memlm.memory.product_keys as product_keys
from memlm.config.run import compose
from memlm.distributed.precision import enable_tf32
from memlm.errors import ConfigError
from memlm.memory import ProductKeys
from memlm.memory.sparse_adamw import SparseRowAdamW
from memlm.train.trainer import Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=4", "optim.warmup=0", "optim.lr=3e-3",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false"]
MEMPLUS = [*BASE, "model.n_layers=3", "memory=memplus", "memory.layers=[1]", "memory.n_keys=16",
           "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2", "memory.value_lr=1e-2"]


def _batches(n: int, rows: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (n, rows, 17), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _trainer(overrides, tmp_path, name, batches):
    return Trainer(compose([*overrides, f"dump_dir={tmp_path / name}"]), train_loader=iter(batches))


class DtypeProbe:
    """Records the dtypes seen inside a forward: every nn.Linear's output, the
    attention kernel's inputs, the product-key sub-scores, the scores the
    top-k returns and the softmax weights of the lookup."""

    def __init__(self, model: nn.Module, monkeypatch=None):
        patch = monkeypatch.setattr if monkeypatch is not None else setattr  # (a spawned rank: no undo needed)
        self.seen: dict[str, set[torch.dtype]] = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda m, i, out: self._add("linear", out))
            if isinstance(module, ProductKeys):
                module.register_forward_hook(lambda m, i, out: self._add("pk_weights", out[0]))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        scores, topk = search_grad.subkey_scores, search_grad.topk_with_ranks

        def record_sdpa(q, k, v, *args, **kwargs):
            self._add("attention_inputs", q, k, v)
            return sdpa(q, k, v, *args, **kwargs)

        def record_scores(*args):
            out = scores(*args)
            self._add("pk_sub_scores", out)
            return out

        def record_topk(sub, *args):
            out = topk(sub, *args)
            self._add("pk_topk_scores", out[0])
            return out

        exact_scores = product_keys.exact_subkey_scores

        def record_exact_scores(*args):
            out = exact_scores(*args)
            self._add("pk_sub_scores", out)
            return out

        patch(torch.nn.functional, "scaled_dot_product_attention", record_sdpa)
        patch(search_grad, "subkey_scores", record_scores)
        patch(product_keys, "exact_subkey_scores", record_exact_scores)  # the balance loss' path
        patch(search_grad, "topk_with_ranks", record_topk)

    def _add(self, name: str, *tensors: torch.Tensor) -> None:
        self.seen.setdefault(name, set()).update(t.dtype for t in tensors)


@pytest.mark.parametrize("balance", [0.0, 0.1], ids=["search", "balance_loss"])
def test_bf16_on_one_process_computes_in_bf16_and_scores_in_fp32(tmp_path, monkeypatch, balance):
    t = _trainer([*MEMPLUS, "parallel.dtype=bf16", f"memory.balance_loss_coef={balance}"], tmp_path, "bf16",
                 _batches(1))
    assert t.meshes.fsdp is None  # one process: no FSDP, the bf16 comes from autocast
    probe = DtypeProbe(t.model, monkeypatch)
    t.train_step()
    assert probe.seen["linear"] == {torch.bfloat16}
    assert probe.seen["attention_inputs"] == {torch.bfloat16}
    assert probe.seen["pk_sub_scores"] == {torch.float32}
    if balance == 0.0:  # (the balance loss' path takes its top-k through autograd, not the search)
        assert probe.seen["pk_topk_scores"] == {torch.float32}
    assert probe.seen["pk_weights"] == {torch.float32}


@pytest.mark.slow  # 2 gloo ranks: ~35 s on a busy 2-core machine, mostly process start-up
def test_memory_parallel_bf16_table_keeps_read_weights_and_their_gradients_fp32(tmp_path):
    """memory_parallel=2 with a bf16 table: the read weights are all-gathered,
    and their partial gradients exchanged and summed, in float32 (they were
    rounded to the table's bf16). Through the Triton kernels (their
    interpreter here), which read float32 weights and accumulate in float32,
    the weight gradient is then float32's (it was off by bf16's 2**-9); the
    torch kernel reads in the table's dtype, as one process does."""
    from precision_workers import column_parallel_bf16_read

    pytest.importorskip("triton")
    out = tmp_path / "read.pt"
    bags, k = 6, 4
    run_ranks(column_parallel_bf16_read, 2, 50, 8, bags, k, str(out))
    for rank in torch.load(out, weights_only=True):
        for kernel, got in rank.items():
            fp32 = "torch.float32"
            assert got["wire"] == [  # forward: indices, weights, rows; backward: output grads, weight grads
                ("all_gather", "torch.int64", (bags, k)), ("all_gather", fp32, (bags, k)),
                ("all_to_all", "torch.bfloat16", (2 * bags, 4)),
                ("all_to_all", "torch.bfloat16", (2 * bags, 4)), ("all_to_all", fp32, (2 * bags, k)),
            ], kernel
            assert got["out_dtype"] == "torch.bfloat16" and got["w_grad_dtype"] == fp32
            # The output is stored in bf16: within one bf16 ulp (the interpreter's cast truncates).
            assert got["out_rel"] <= 2**-7, (kernel, got)
        assert rank["triton"]["w_grad_rel"] <= 1e-6, rank["triton"]
        assert rank["torch"]["w_grad_rel"] <= 2**-7, rank["torch"]  # partial dot products stored in bf16


def test_fp32_run_computes_in_fp32(tmp_path, monkeypatch):
    t = _trainer([*MEMPLUS, "parallel.dtype=fp32"], tmp_path, "fp32", _batches(1))
    probe = DtypeProbe(t.model, monkeypatch)
    t.train_step()
    assert {d for dtypes in probe.seen.values() for d in dtypes} == {torch.float32}


def test_bf16_keeps_fp32_master_weights_and_optimizer_state(tmp_path):
    t = _trainer([*MEMPLUS, "parallel.dtype=bf16"], tmp_path, "bf16", _batches(2))
    for _ in range(2):
        t.train_step()
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}
    state = [v for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert state and {v.dtype for v in state} == {torch.float32}


# How close must a bf16 run stay to the fp32 run? bf16 keeps 8 significant
# bits: every matmul input is rounded by up to 2**-9 (0.2%) relative.
# - Dense model (memorizing 4 batches, loss 5.4 -> 1.9): the per-step losses
#   differ by at most 0.05% (measured); 5e-3 per step is 10x headroom.
# - Memory+ model: the top-k selection is discontinuous, so any 2**-9
#   perturbation flips some slot choices and the runs wander apart. Measured:
#   an fp32 run whose initial weights get one 2**-9 perturbation differs from
#   the unperturbed one by up to 5% at single steps and 0.4-0.5% in the mean
#   loss over 20 steps; the bf16 run: 4.9% and 0.6% (a bf16 value table with
#   fp32 compute: 3.5% and 0.0%). So each step within 1e-1 and the 20-step
#   mean within 2e-2, both far below what 20 steps of training move the loss
#   (checked: the fp32 loss falls by more than half, 5.1 -> 2.2).
STEP_RTOL = {"dense": 5e-3, "memplus": 1e-1}
MEAN_RTOL = 2e-2


def _assert_follows(got: list[float], want: list[float], step_rtol: float) -> None:
    assert got == pytest.approx(want, rel=step_rtol)
    assert sum(got) / len(got) == pytest.approx(sum(want) / len(want), rel=MEAN_RTOL)
    assert want[-1] < want[0] / 2  # training moved the loss far more than the tolerances


@pytest.mark.parametrize("memory", ["dense", "memplus"])
def test_bf16_loss_follows_fp32_over_20_steps(tmp_path, memory):
    overrides = [*(BASE if memory == "dense" else MEMPLUS), "optim.lr=1e-3"]
    batches = _batches(4) * 5
    ref = _trainer([*overrides, "parallel.dtype=fp32"], tmp_path, "fp32", batches)
    bf16 = _trainer([*overrides, "parallel.dtype=bf16"], tmp_path, "bf16", batches)
    want = [ref.train_step()["loss"] for _ in range(20)]
    got = [bf16.train_step()["loss"] for _ in range(20)]
    _assert_follows(got, want, STEP_RTOL[memory])
    assert got != want  # the bf16 run did compute in bf16


VALUES_BF16 = [*MEMPLUS, "memory.value_dtype=bf16"]


def test_bf16_value_table_keeps_fp32_moments_and_trains(tmp_path):
    batches = _batches(4) * 5
    t = _trainer([*VALUES_BF16, "optim.lr=1e-3"], tmp_path, "bf16_values", batches)
    ref = _trainer([*MEMPLUS, "optim.lr=1e-3"], tmp_path, "fp32_values", batches)
    table = t.model.shared.memory_values.weight
    assert table.dtype == torch.bfloat16
    assert {p.dtype for p in t.model.parameters() if p is not table} == {torch.float32}
    before = table.detach().clone()
    got = [t.train_step()["loss"] for _ in range(20)]
    want = [ref.train_step()["loss"] for _ in range(20)]
    state = t.optimizer.state[table]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert table.dtype == torch.bfloat16 and not torch.equal(table.detach(), before)
    _assert_follows(got, want, STEP_RTOL["memplus"])


def test_unknown_value_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match=r"memory.value_dtype='fp16'.*one of: fp32, bf16"):
        compose([*MEMPLUS, "memory.value_dtype=fp16"])


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_grad", "sparse_grad"])
def test_bf16_table_update_is_fp32_adamw_rounded_once(sparse):
    # Reference: AdamW on a float32 copy of the bf16 table, float32 moments.
    torch.manual_seed(0)
    table = torch.randn(64, 8).bfloat16()
    grads = [torch.randn(64, 8) for _ in range(3)]
    rows = torch.tensor([1, 5, 9, 40])
    low = nn.Parameter(table.clone())
    wide = nn.Parameter(table.float())
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_low, opt_wide = SparseRowAdamW([low], **kwargs), SparseRowAdamW([wide], **kwargs)
    for g in grads:
        if sparse:
            g = torch.sparse_coo_tensor(rows.unsqueeze(0), g[rows], g.shape, check_invariants=True).coalesce()
        low.grad, wide.grad = g.bfloat16(), g.bfloat16().float()
        opt_low.step()
        opt_wide.step()
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.detach(), wide.detach().bfloat16(), atol=0, rtol=0)
        wide.data.copy_(low.detach().float())  # both continue from the rounded table
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt_low.state[low][key].dtype == torch.float32
        torch.testing.assert_close(opt_low.state[low][key], opt_wide.state[wide][key], atol=0, rtol=0)


def test_tf32_is_set_for_cuda_only(matmul_precision):
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        enable_tf32(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        enable_tf32(torch.device("cuda", 0))  # only flags: no GPU needed
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _two_rank_dtypes(rank: int, overrides: list[str], out_path: str) -> None:
    """One step on this rank for each (value dtype, memory_parallel); rank 0
    saves the dtypes seen and held. memory_parallel=1: the bf16 table's
    gradient is all-reduced over 2 replicas; 2: read column-parallel."""
    from torch.distributed.tensor import DTensor

    results = {}
    for values, memory_parallel in (("fp32", 2), ("bf16", 2), ("bf16", 1)):
        batches = _batches(1, rows=4)
        mine = iter([(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]) for x, y in batches])
        cfg = compose([*overrides, f"memory.value_dtype={values}", f"parallel.memory_parallel={memory_parallel}"])
        t = Trainer(cfg, train_loader=mine)
        probe = DtypeProbe(t.model)
        t.train_step()
        local = [p.to_local() if isinstance(p, DTensor) else p for p in t.model.parameters()]
        state = [v for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        assert torch.isfinite(t.model.shared.memory_values.weight.to_local()).all()
        results[f"{values}/{memory_parallel}"] = {
            "fsdp": t.meshes.fsdp is not None, "seen": {k: sorted(map(str, v)) for k, v in probe.seen.items()},
            "params": sorted({str(p.dtype) for p in local}), "state": sorted({str(v.dtype) for v in state}),
            "table": str(t.model.shared.memory_values.weight.dtype),
        }
        t.close()  # its run lock: the next Trainer uses the same dump_dir
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.slow  # ~45 s on a busy 2-core machine, nearly all of it process start-up
def test_two_fsdp_ranks_compute_in_bf16_with_fp32_scores_and_state(tmp_path):
    out = tmp_path / "dtypes.pt"
    overrides = [*MEMPLUS, "data.micro_batch=2", "parallel.dtype=bf16", f"dump_dir={tmp_path / 'run'}"]
    run_ranks(_two_rank_dtypes, 2, overrides, str(out))
    bf16, fp32 = ["torch.bfloat16"], ["torch.float32"]
    results = torch.load(out, weights_only=True)
    assert sorted(results) == ["bf16/1", "bf16/2", "fp32/2"]
    for run, got in results.items():
        values = run.split("/")[0]
        assert got["fsdp"]  # FSDP2's policy makes the bf16 here, not autocast
        assert got["seen"]["linear"] == got["seen"]["attention_inputs"] == bf16
        assert got["seen"]["pk_sub_scores"] == got["seen"]["pk_topk_scores"] == got["seen"]["pk_weights"] == fp32
        assert got["table"] == ("torch.bfloat16" if values == "bf16" else "torch.float32")
        assert got["params"] == sorted({"torch.float32", got["table"]})  # fp32 master shards (and the table)
        assert got["state"] == fp32


def test_bf16_value_table_checkpoint_loads_for_evaluation_as_stored(tmp_path):
    from memlm.run.load import load_model

    t = _trainer([*VALUES_BF16, "steps=2", "checkpoint.at_end=true", "parallel.dtype=bf16"], tmp_path, "run",
                 _batches(2))
    t.fit()
    loaded = load_model(tmp_path / "run")
    table = loaded.model.shared.memory_values.weight
    assert table.dtype == torch.bfloat16
    assert torch.equal(table, t.model.shared.memory_values.weight.detach())
    # Evaluation: fp32 weights around the bf16 table, no autocast; fp32 logits.
    assert {p.dtype for p in loaded.model.parameters() if p is not table} == {torch.float32}
    assert loaded.model(torch.randint(0, 128, (1, 8))).dtype == torch.float32
