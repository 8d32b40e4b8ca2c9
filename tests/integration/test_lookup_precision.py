"""The product-key lookup's precision (memlm.memory.fast.exact.no_tf32): at the published shape a lookup
in bf16 or with TF32 operands selects other slots than the float32 model for a few percent of the lookups
(measured below); memlm's lookup computes in IEEE float32 whatever the caller's autocast, TF32 setting or
FSDP mixed-precision policy. The rest of mixed precision is tests/integration/test_precision.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_and_build

import memlm.memory.fast.exact as exact
import memlm.memory.fast.search_grad as search_grad
from memlm.config.run import compose
from memlm.distributed.precision import enable_tf32
from memlm.memory import ProductKeys
from memlm.memory.fast.exact import no_tf32

# The product-key selection.
# At the published shape (n_keys 1024, k_dim 512, knn 32) a lookup in bf16 or
# with TF32 operands selects other slots than the float32 model for a few
# percent of the lookups (the tests below measure it); memlm's lookup computes
# in IEEE float32 whatever the caller's autocast, TF32 setting or FSDP policy.
SHAPE = dict(n_keys=1024, k_dim=512, knn=32)
DIM, HEADS, TOKENS = 256, 2, 512  # 1024 lookups


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to TF32, as tensor cores read a float32 operand:
    10 significand bits (of 23), round to nearest even."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFF + ((bits >> 13) & 1)) & -0x2000).view(torch.float32).view_as(x)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def cublas_tf32() -> bool:
    """Would cuBLAS run a float32 matmul with TF32 now? What it reads: from
    torch 2.9 the CUDA matmul fp32_precision ("none" inherits the generic
    one), before that the legacy allow_tf32."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision
    except AttributeError:  # torch < 2.9
        return matmul.allow_tf32
    if precision == "none":
        precision = torch.backends.fp32_precision
    return precision == "tf32"


class TF32Emulation:
    """cuBLAS's TF32 on CPU: while cublas_tf32() says so at call time, the
    float32 operands of torch.einsum and F.linear (the lookup's two matmuls)
    are rounded to TF32 first. Counts the float32 calls made each way."""

    def __init__(self, monkeypatch):
        self.rounded = self.exact = 0
        einsum, linear = torch.einsum, F.linear

        def round_all(*tensors):
            fp32 = [t is not None and t.dtype == torch.float32 for t in tensors]
            if not any(fp32):
                return tensors
            if cublas_tf32():
                self.rounded += 1
                return [_tf32(t) if f else t for t, f in zip(tensors, fp32)]
            self.exact += 1
            return tensors

        monkeypatch.setattr(torch, "einsum", lambda eq, *ops: einsum(eq, *round_all(*ops)))
        monkeypatch.setattr(F, "linear", lambda x, w, b=None: linear(*round_all(x, w), b))


def _precision_state() -> list:
    """Every reading of the matmul precision a caller can make (a read that raises reads as its error type)."""
    reads = [torch.get_float32_matmul_precision, lambda: torch.backends.cuda.matmul.allow_tf32,
             lambda: torch.backends.cuda.matmul.fp32_precision, lambda: torch.backends.mkldnn.matmul.fp32_precision,
             lambda: torch.backends.fp32_precision]
    state = []
    for read in reads:
        try:
            state.append(read())
        except (RuntimeError, AttributeError) as e:
            state.append(type(e).__name__)
    return state


def _set_new_api(target, value):
    if not hasattr(target, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    target.fp32_precision = value


CALLER_SETTINGS = {
    "default": lambda: None,
    "enable_tf32": lambda: enable_tf32(torch.device("cuda", 0)),  # memlm's own, on a GPU
    "set_float32_matmul_precision_high": lambda: torch.set_float32_matmul_precision("high"),
    "set_float32_matmul_precision_medium": lambda: torch.set_float32_matmul_precision("medium"),
    "new_api_cuda_matmul": lambda: _set_new_api(torch.backends.cuda.matmul, "tf32"),
    "new_api_generic": lambda: _set_new_api(torch.backends, "tf32"),
}


@pytest.mark.parametrize("setting", CALLER_SETTINGS)
def test_no_tf32_turns_tf32_off_inside_and_restores_the_callers_setting(matmul_precision, setting):
    cudnn = torch.backends.cudnn.allow_tf32
    try:
        CALLER_SETTINGS[setting]()
        before = _precision_state()
        assert cublas_tf32() == (setting != "default")
        with no_tf32():
            assert not cublas_tf32()
        assert _precision_state() == before
        with pytest.raises(KeyError), no_tf32():  # restored on error too
            raise KeyError
        assert _precision_state() == before and cublas_tf32() == (setting != "default")
    finally:
        torch.backends.cudnn.allow_tf32 = cudnn


def _lookup_and_input(seed: int = 0) -> tuple[ProductKeys, torch.Tensor]:
    torch.manual_seed(seed)
    lookup = ProductKeys(DIM, heads=HEADS, **SHAPE)
    return lookup, torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(seed + 1))


def reference_slots(x, weight, bias, keys, knn, project=lambda t: t, query=lambda t: t,
                    score=lambda t: t) -> torch.Tensor:
    """Plain PyTorch in float32: the query projection, the sub-key scores and
    the exact two-stage top-k (each half's top-knn, then the best knn of their
    knn**2 sums). `project` rounds the projection's operands (x, weight),
    `query` its output, `score` the scoring's operands (query, keys): TF32,
    bf16. x (T, dim), weight (H * k_dim, dim), keys (H, 2, n_keys, half) ->
    (T, H, knn) slots, sorted."""
    x, weight, bias, keys = (t.detach().float() for t in (x, weight, bias, keys))
    heads, _, n_keys, half = keys.shape
    q = query(project(x) @ project(weight).t() + bias).view(-1, heads, 2, half)  # (T, H, 2, half)
    sub = (score(q).permute(1, 2, 0, 3) @ score(keys).transpose(-1, -2)).permute(2, 0, 1, 3)  # (T, H, 2, n_keys)
    s, idx = sub.topk(knn, dim=-1)  # (T, H, 2, knn)
    pairs = (s[:, :, 0, :, None] + s[:, :, 1, None, :]).flatten(-2)  # (T, H, knn * knn)
    best = pairs.topk(knn, dim=-1).indices
    slots = idx[:, :, 0].gather(-1, best // knn) * n_keys + idx[:, :, 1].gather(-1, best % knn)
    return slots.sort(-1).values


def _changed(slots: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of the (token, head) lookups whose selected set differs."""
    return (slots.view_as(ref).sort(-1).values != ref).any(-1).float().mean().item()


def test_reference_top_k_equals_brute_force():
    gen = torch.Generator().manual_seed(3)
    x, w, b, keys = torch.randn(6, 8, generator=gen), torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen), \
        torch.randn(2, 2, 20, 2, generator=gen)
    q = (x @ w.t() + b).view(6, 2, 2, 2)
    sub = torch.einsum("thcd,hcnd->thcn", q, keys)
    brute = (sub[:, :, 0, :, None] + sub[:, :, 1, None, :]).flatten(-2).topk(5, dim=-1).indices
    assert torch.equal(reference_slots(x, w, b, keys, 5), brute.sort(-1).values)


@pytest.mark.parametrize("sub", ["none", "detached", "grad"])
def test_lookup_selects_the_fp32_slots_under_bf16_autocast_with_tf32_on(monkeypatch, matmul_precision, sub):
    """ProductKeys at n_keys 1024, k_dim 512, knn 32 inside a bf16-autocast
    model on a GPU with TF32 on (emulated): the slots plain float32 selects,
    the float32 softmax weights, and the caller's TF32 setting back after."""
    lookup, x = _lookup_and_input()
    keys = lookup.keys
    ref = reference_slots(x, lookup.query.weight, lookup.query.bias, keys, SHAPE["knn"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lookup.query(x).dtype == torch.bfloat16  # autocast is on for ordinary layers
    emulation = TF32Emulation(monkeypatch)
    enable_tf32(torch.device("cuda", 0))  # what the trainer sets on a GPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, slots, _ = lookup(x, sub=sub)
    assert torch.backends.cuda.matmul.allow_tf32 and cublas_tf32()  # the caller's setting, restored
    assert emulation.rounded == 0 and emulation.exact >= 2  # the projection and the scores, TF32 off
    assert weights.dtype == torch.float32
    assert _changed(slots, ref) == 0
    # The weights: the float32 softmax of the selected slots' float32 scores.
    q = (x @ lookup.query.weight.detach().t() + lookup.query.bias.detach()).view(TOKENS, HEADS, 2, -1)
    sub_ref = (q.permute(1, 2, 0, 3) @ keys.detach().transpose(-1, -2)).permute(2, 0, 1, 3)  # (T, H, 2, n_keys)
    slots = slots.view(TOKENS, HEADS, -1)
    n = SHAPE["n_keys"]
    scores = sub_ref[:, :, 0].gather(-1, slots // n) + sub_ref[:, :, 1].gather(-1, slots % n)
    torch.testing.assert_close(weights.detach().view_as(scores), scores.softmax(-1), rtol=1e-5, atol=1e-7)


def test_what_the_lookup_would_select_in_bf16_or_with_tf32(monkeypatch, matmul_precision):
    """The checks above can fail: at this shape each way of rounding the
    lookup's matmuls changes the selection of some lookups. Measured (1024
    lookups): TF32 scores 2.0%; TF32 query and scores 2.7%; bf16 query (the
    old autocast path) 19%; bf16 query and keys (the old FSDP policy) 23%."""
    lookup, x = _lookup_and_input()
    w, b, keys, knn = lookup.query.weight, lookup.query.bias, lookup.keys, SHAPE["knn"]
    ref = reference_slots(x, w, b, keys, knn)
    assert _changed(reference_slots(x, w, b, keys, knn, score=_tf32), ref) > 0.01
    assert _changed(reference_slots(x, w, b, keys, knn, project=_tf32, score=_tf32), ref) > 0.01
    assert _changed(reference_slots(x, w, b, keys, knn, project=_bf16, query=_bf16), ref) > 0.15
    assert _changed(reference_slots(x, w, b, _bf16(keys), knn, project=_bf16, query=_bf16), ref) > 0.15
    # And the emulation bites the search itself once no_tf32 is out of its way.
    TF32Emulation(monkeypatch)
    monkeypatch.setattr(exact, "no_tf32", contextlib.nullcontext)
    monkeypatch.setattr(search_grad, "no_tf32", contextlib.nullcontext)
    enable_tf32(torch.device("cuda", 0))
    _, slots, _ = lookup(x, sub="none")
    assert _changed(slots, ref) > 0.01


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group in this process: FSDP2 applies its
    mixed-precision policy (the all-gather casts) on one rank as on many."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


MEMPLUS_1M = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=1024", "memory.k_dim=512", "memory.knn=32",
              f"memory.heads={HEADS}", "memory.v_dim=8", "parallel.dtype=bf16"]


def test_fsdp_gathers_the_lookup_in_fp32_and_selects_the_fp32_slots(one_rank_group):
    """train.parallelize.apply_fsdp with the bf16 policy (parallel.dtype=bf16,
    the GPU default) on a model with a lookup at n_keys 1024, k_dim 512, knn
    32: the attention computes in bf16, the lookup gets float32 query weights
    and sub-keys and a float32 input, and selects the slots plain float32
    selects for that input (the old policy, bf16 input, query and keys: not)."""

    from torch.distributed.device_mesh import init_device_mesh

    from memlm.distributed.env import Meshes
    from memlm.distributed.parallelize import apply_fsdp

    model, cfg = compose_and_build(MEMPLUS_1M)
    lookup = next(m for m in model.modules() if isinstance(m, ProductKeys))
    w, b, keys = (t.detach().clone() for t in (lookup.query.weight, lookup.query.bias, lookup.keys))
    seen = {}

    def record_lookup(module, args, out):
        seen["lookup"] = (module.query.weight.dtype, module.keys.dtype, args[0].dtype)
        seen["x"], seen["slots"] = args[0].detach().clone(), out[1]

    lookup.register_forward_hook(record_lookup)
    def record_attention(module, args, out):
        seen["attention"] = module.weight.dtype

    model.layers[1].attention.wq.register_forward_hook(record_attention)
    apply_fsdp(model, Meshes(init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)), None), cfg.parallel,
               torch.device("cuda"))
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    model(tokens).float().sum().backward()  # (a backward through the nested unit too)
    assert seen["attention"] == torch.bfloat16
    assert seen["lookup"] == (torch.float32,) * 3
    x = seen["x"]  # the block's bf16 activations, cast to float32 by the lookup's unit
    ref = reference_slots(x, w, b, keys, 32)
    assert _changed(seen["slots"], ref) == 0
    assert lookup.keys.grad is not None and lookup.keys.grad.dtype == torch.float32
    assert _changed(reference_slots(x, w, b, _bf16(keys), 32, project=_bf16, query=_bf16), ref) > 0.1


def test_fsdp_plan_at_8b_gathers_every_lookup_in_fp32():
    """The 8b Memory+ preset on 64 fake ranks (meta tensors), the GPU policy:
    every lookup is an FSDP unit of its own whose all-gather is float32
    (query projection and sub-keys), inside blocks gathered in bf16."""
    from torch.distributed.fsdp import FSDPModule

    from memlm.distributed.env import DistEnv, build_meshes
    from memlm.distributed.memory_hooks import resolve_memory_parallel
    from memlm.distributed.parallelize import apply_fsdp
    from memlm.model import Transformer
    from memlm.plan.planner import fake_process_group

    cfg = compose(["model=8b", "memory=memplus"])
    with fake_process_group(64, 0):
        env = DistEnv(0, 64, 0, 8, torch.device("cpu"))
        meshes = build_meshes(env, resolve_memory_parallel(cfg, 64, 8), cfg.parallel.fsdp)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.memory)
        apply_fsdp(model, meshes, cfg.parallel, torch.device("cuda"))
        units = {id(m): m for m in model.modules() if isinstance(m, FSDPModule)}

        names = {id(p): name for name, p in model.named_parameters()}

        def gather_dtypes(module) -> dict[str, torch.dtype]:
            """{parameter name: the dtype its unit all-gathers in} of the unit `module`."""
            group = module._get_fsdp_state()._fsdp_param_group
            return {names[id(fp.sharded_param)]: group.mp_policy.param_dtype for fp in group.fsdp_params}

        lookups = [m for m in model.modules() if isinstance(m, ProductKeys)]
        assert len(lookups) == 3 and all(id(m) in units for m in lookups)
        for lookup in lookups:
            dtypes = gather_dtypes(lookup)
            assert {k.split("lookup.")[-1] for k in dtypes} == {"query.weight", "query.bias", "keys"}, dtypes
            assert set(dtypes.values()) == {torch.float32}
        blocks = [gather_dtypes(block) for block in model.layers]
        assert all(set(d.values()) == {torch.bfloat16} and not any("lookup" in k for k in d) for d in blocks)
