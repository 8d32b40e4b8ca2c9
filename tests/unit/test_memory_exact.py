"""The memory read is the plain formulation bit for bit: float32 on CPU, `==`, no tolerance.

The plain formulation is the one of Meta's layer and of memlm's Hugging Face
remote code (hf/remote/modeling_memlm.py, shipped in every export): the query
`W_q x + b`, the sub-key scores, the exact top-knn of the candidate sums,
`softmax` over each head's knn scores, one `F.embedding_bag` of the H*knn rows,
then the variant's output. memlm's layers run their own search (custom ops,
the C top-k) and read through their own op, but every number they compute
must equal the plain one exactly:

- a Memory / Memory+ layer equals the remote layer with its weights, in
  training (knn) and eval (eval_knn), and its read weights are `softmax` of
  its own selected scores (an `exp(s - logsumexp(s))` there differs in the
  last bits, up to 1e-7: the regression of issue #41);
- a Memory+ / Memory model equals its export loaded by transformers
  (AutoModelForCausalLM, trust_remote_code): logits 0.0 apart;
- with W1/W2 biases (memory.w_bias, the official code's projections), the same:
  the forward `==` the plain formulation with biases, gradients within 1e-6
  relative of autograd's through it (every case), the export's logits 0.0 apart;
- under bf16 autocast the remote lookup, like memlm's, projects its query in
  float32: the same slots and weights, `==`;
- the lookup still returns fresh tensors, so FSDP2 (memlm.distributed.parallelize's
  units) does not warn about a returned view.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from safetensors.torch import save_file  # noqa: E402

from memlm.hf import remote as hf_remote  # noqa: E402
from memlm.hf.remote.modeling_memlm import ProductKeyMemory as RemoteMemory  # noqa: E402
from memlm.memory import Memory, MemoryPlus  # noqa: E402
from memlm.memory.config import MemoryConfig  # noqa: E402
from memlm.model import ModelArgs, build_model  # noqa: E402

SIZES = dict(n_keys=16, heads=2, knn=8, eval_knn=4, k_dim=16)
CASES = [
    (Memory, {}),
    (Memory, {"v_dim": 24}),  # output projection
    (MemoryPlus, {"gate": "swilu"}),
    (MemoryPlus, {"gate": "swilu", "qk_norm": True}),
    (MemoryPlus, {"gate": "sigmoid", "v_dim": 24}),
    (MemoryPlus, {"gate": "none"}),
    # memory.w_bias: W2(y * gate(W1 x + b1)) + b2
    (MemoryPlus, {"gate": "swilu", "bias": True}),
    (MemoryPlus, {"gate": "sigmoid", "v_dim": 24, "qk_norm": True, "bias": True}),
    (MemoryPlus, {"gate": "none", "bias": True}),
]


@torch.no_grad()
def _random_biases(module: torch.nn.Module) -> None:
    """Biases away from their zero init (the query's too), so that each one counts in a comparison."""
    gen = torch.Generator().manual_seed(3)
    for name, p in module.named_parameters():
        if name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def _layer(cls, training: bool, **kwargs):
    torch.manual_seed(0)
    layer = cls(32, **{**SIZES, **kwargs}).train(training)
    _random_biases(layer)
    return layer


def _remote_twin(layer) -> RemoteMemory:
    """The exported (plain) layer with the memlm layer's settings and weights, float32."""
    lk = layer.lookup
    plus = isinstance(layer, MemoryPlus)
    m = dict(n_keys=lk.n_keys, heads=lk.heads, knn=lk.knn, eval_knn=lk.eval_knn, k_dim=lk.k_dim,
             v_dim=layer.v_dim, qk_norm=lk.qk_norm, gate=getattr(layer, "gate", "none"), value_dtype="fp32")
    if plus and layer.w2.bias is not None:
        m["w_bias"] = True  # as config.json carries it: only when on
    remote = RemoteMemory(layer.dim, m, plus=plus, pool=None)
    missing, unexpected = remote.load_state_dict(layer.state_dict(), strict=False)
    assert not missing, missing
    assert not unexpected, unexpected  # the same tensors: with biases too
    return remote.train(layer.training)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls,kwargs", CASES, ids=lambda c: c.__name__ if isinstance(c, type) else str(c))
def test_the_layer_equals_the_plain_formulation_bit_for_bit(cls, kwargs, training):
    layer = _layer(cls, training, **kwargs)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, plain = layer(x), _remote_twin(layer)(x)
    assert out.dtype == plain.dtype == torch.float32
    diff = (out - plain).abs().max().item()
    assert diff == 0.0, f"max |memlm - plain| {diff}"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls,kwargs", CASES, ids=lambda c: c.__name__ if isinstance(c, type) else str(c))
def test_gradients_equal_the_plain_formulation_within_1e_6(cls, kwargs, training):
    """memlm's backward (the search's sparse backward, its own read backward) against
    autograd through the plain formulation: every parameter's gradient and the input's,
    max |memlm - plain| <= 1e-6 * max |plain|, float32."""
    layer = _layer(cls, training, **kwargs)
    remote = _remote_twin(layer)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1))
    g = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(2))
    ours, theirs = dict(layer.named_parameters()), dict(remote.named_parameters())
    assert set(ours) == set(theirs)
    names = sorted(ours)
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    grads = torch.autograd.grad(layer(xs[0]), [xs[0], *(ours[n] for n in names)], g)
    plain = torch.autograd.grad(remote(xs[1]), [xs[1], *(theirs[n] for n in names)], g)
    for name, a, b in zip(["x", *names], grads, plain):
        scale = b.abs().max().item()
        assert scale > 0, f"{name}: no gradient to compare"
        rel = (a - b).abs().max().item() / scale
        assert rel <= 1e-6, f"{name}: max |memlm - plain| / max |plain| = {rel:.3g}"


def test_the_remote_lookup_projects_its_query_in_float32_under_autocast():
    """Under bf16 autocast both lookups run the query projection in float32 with
    autocast off: the remote one selects memlm's slots with memlm's weights, `==`
    (a bf16 query changes the selection: docs/memory.md, "The math, as implemented")."""
    layer = _layer(MemoryPlus, True, bias=True)
    remote = _remote_twin(layer)
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        weights, slots, _ = layer.lookup(x)
        plain_weights, plain_slots = remote.lookup(x)
        bf16_query = remote.lookup.query(x)  # what autocast makes of the projection outside the lookup
    assert bf16_query.dtype == torch.bfloat16  # (the test runs under autocast)
    assert plain_weights.dtype == weights.dtype == torch.float32
    assert torch.equal(plain_slots, slots)
    diff = (plain_weights - weights).abs().max().item()
    assert diff == 0.0, f"max |memlm - remote| weight {diff}"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_read_weights_are_softmax_of_the_selected_scores(training):
    """The lookup's weights equal `softmax` of its own selected scores exactly."""
    lookup = _layer(MemoryPlus, training).lookup
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights, slots, sub = lookup(x)  # (T, H*knn) x 2, (T, H, 2, n_keys)
        knn = lookup.current_knn
        # The winners' scores, from the kept sub-key scores: slot i*n + j scores s1[i] + s2[j].
        i, j = (slots // lookup.n_keys).view(50, lookup.heads, knn), (slots % lookup.n_keys).view(50, lookup.heads, knn)
        scores = sub[:, :, 0].gather(-1, i) + sub[:, :, 1].gather(-1, j)  # (T, H, knn)
    diff = (weights - scores.softmax(dim=-1).flatten(1)).abs().max().item()
    assert diff == 0.0, f"max |weights - softmax(scores)| {diff}"


def _memlm_model(kind: str, w_bias: bool = False):
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=16, max_seq_len=64,
                     rope_theta=5000.0)
    memory = MemoryConfig(kind=kind, layers=[1], n_keys=8, knn=4, eval_knn=3, heads=2, k_dim=16, w_bias=w_bias)
    model = build_model(args, memory, seed=0).eval()
    if w_bias:
        _random_biases(model)
    return model, args, memory


@pytest.mark.parametrize("kind,w_bias", [("memplus", False), ("memory", False), ("memplus", True)],
                         ids=["memplus", "memory", "memplus_w_bias"])
def test_an_export_in_transformers_equals_memlm_bit_for_bit(tmp_path, kind, w_bias):
    """What run/export.py writes for a memory model (memlm-named safetensors and
    the remote code), loaded the way users load it."""
    model, args, memory = _memlm_model(kind, w_bias)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    hf_remote.write_remote_code(tmp_path, args, memory)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.dtype == theirs.dtype == torch.float32
    diff = (ours - theirs).abs().max().item()
    assert diff == 0.0, f"max |memlm - transformers| logit {diff}"


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group in this process: FSDP2 wraps on one rank as on many."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_does_not_warn_about_the_lookup(one_rank_group):
    """memlm's FSDP units (the lookup is one of its own) return no view: FSDP2
    warns, every step, for an FSDP unit whose output is a view."""
    from torch.distributed.device_mesh import init_device_mesh

    from memlm.config.run import ParallelConfig
    from memlm.distributed.env import Meshes
    from memlm.distributed.parallelize import apply_fsdp

    model, _, _ = _memlm_model("memplus")
    model.train()
    apply_fsdp(model, Meshes(init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)), None),
               ParallelConfig(dtype="fp32"), torch.device("cpu"))
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(tokens).sum().backward()
    fsdp = [str(w.message) for w in caught if "FSDP" in str(w.message)]
    assert not fsdp, fsdp
