"""Engram (memory/engram.py) against its reference (memory/engram_reference.py), bit for bit in
float32; the hash against a hand-computed case; the token map on hand-picked pieces; causality;
determinism; errors."""

from __future__ import annotations

import json

import pytest
import torch

from memlm.errors import ConfigError
from memlm.memory.engram import Engram, signed_sqrt
from memlm.memory.engram_hash import head_primes, is_prime, layer_multipliers, ngram_hash, splitmix64
from memlm.memory.engram_reference import engram_reference, reference_primes, reference_rows
from memlm.memory.engram_vocab import canonical_map, load_canonical_map, normalize_piece, save_canonical_map
from memlm.memory.tables import sparse_tables, split_params

# 12 token ids onto 9 canonical ids (3 and 1, 6 and 2, 9 and 0 merged): collisions in the map too
TOKEN_MAP = torch.tensor([0, 1, 2, 1, 3, 4, 2, 5, 6, 0, 7, 8])


def randomized(layer: Engram, seed: int = 0) -> Engram:
    """Every parameter drawn at random (the init's zero conv and unit norms would hide their paths)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer


@pytest.mark.parametrize("kwargs", [
    dict(max_order=3, heads=3, head_dim=4, rows_per_head=[7, 11], dim=16),  # defaults' shape, small
    dict(max_order=4, heads=2, head_dim=8, rows_per_head=[2, 3, 40], dim=24, kernel_size=3),  # many collisions
    dict(max_order=2, heads=1, head_dim=5, rows_per_head=50, dim=8, kernel_size=4, dilation=5),
])
def test_module_equals_reference_forward_and_every_gradient(kwargs):
    layer = randomized(Engram(token_map=TOKEN_MAP, layer=3, seed=11, **kwargs))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, len(TOKEN_MAP), (3, 29), generator=gen)
    h = torch.randn(3, 29, kwargs["dim"], generator=gen, requires_grad=True)
    assert torch.equal(layer.hash(tokens), reference_rows(layer, tokens))
    out, ref = layer(h, tokens), engram_reference(layer, h, tokens)
    assert out.shape == h.shape and torch.equal(out, ref)
    grad_out = torch.randn(out.shape, generator=gen)
    names = ["h", *(n for n, _ in layer.named_parameters())]
    inputs = [h, *layer.parameters()]
    got = torch.autograd.grad(out, inputs, grad_out)
    want = torch.autograd.grad(ref, inputs, grad_out)
    assert len(names) == 8  # h, the table, W_k, W_v, three norms, the conv: none left out
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b), name
        assert a.abs().sum() > 0, name  # every path is live


def test_rows_computed_ahead_give_the_same_output():
    layer = randomized(Engram(dim=16, token_map=TOKEN_MAP, layer=0, heads=2, head_dim=4, rows_per_head=13))
    tokens = torch.randint(0, 12, (2, 9))
    h = torch.randn(2, 9, 16)
    assert torch.equal(layer(h, tokens), layer(h, rows=layer.hash(tokens)))


def test_hand_computed_hash():
    # c = canonical ids of 5 tokens, pad = 12 (the map's length), multipliers m = (3, 5, 7), primes (5, 7)
    # for bigrams and (11, 13) for trigrams.
    # bigram mix  c_t*3 ^ c_{t-1}*5:  6^60=58, 21^10=31, 3^35=32, 24^5=29, 9^40=33
    # trigram mix bigram ^ c_{t-2}*7: 58^84=110, 31^84=75, 32^14=46, 29^49=44, 33^7=38
    want = [[58 % 5, 58 % 7, 110 % 11, 110 % 13],  # [3, 2, 0, 6]
            [31 % 5, 31 % 7, 75 % 11, 75 % 13],  # [1, 3, 9, 10]
            [32 % 5, 32 % 7, 46 % 11, 46 % 13],  # [2, 4, 2, 7]
            [29 % 5, 29 % 7, 44 % 11, 44 % 13],  # [4, 1, 0, 5]
            [33 % 5, 33 % 7, 38 % 11, 38 % 13]]  # [3, 5, 5, 12]
    assert want == [[3, 2, 0, 6], [1, 3, 9, 10], [2, 4, 2, 7], [4, 1, 0, 5], [3, 5, 5, 12]]
    canon = torch.tensor([[2, 7, 1, 8, 3]])
    rows = ngram_hash(canon, torch.tensor([3, 5, 7]), torch.tensor([[5, 7], [11, 13]]), pad=12)
    assert rows.tolist() == [want]
    # The module: tokens 10 and 11 map to canonical 2 and 7; its primes for sizes (5, 11) are these;
    # its multipliers patched to (3, 5, 7); the rows carry each head's offset (0, 5, 12, 23).
    token_map = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 7])  # pad = len = 12
    layer = Engram(dim=8, token_map=token_map, layer=0, heads=2, head_dim=2, rows_per_head=[5, 11])
    assert layer.hash.head_rows == [5, 7, 11, 13] and layer.hash.pad == 12
    layer.hash.mult.copy_(torch.tensor([3, 5, 7]))
    got = layer.hash(torch.tensor([[10, 11, 1, 8, 3]]))
    assert got.tolist() == [[[r + off for r, off in zip(row, (0, 5, 12, 23), strict=True)] for row in want]]
    assert layer.tables.weight.shape == (5 + 7 + 11 + 13, 2)


def test_primes():
    assert [n for n in range(60) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47,
                                                     53, 59]
    trial = [n for n in range(2, 5000) if all(n % d for d in range(2, int(n**0.5) + 1))]
    assert [n for n in range(5000) if is_prime(n)] == trial
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)  # a Mersenne prime; 3 divides the other
    assert head_primes([5, 5], 2) == [[5, 7], [11, 13]]  # the second order skips the first's primes
    assert head_primes([20, 2, 100], 3) == reference_primes([20, 2, 100], 3) == [[23, 29, 31], [2, 3, 5],
                                                                                  [101, 103, 107]]


def test_multipliers_are_a_pure_function_of_seed_and_layer():
    # SplitMix64's published outputs for a generator seeded with 0: its first three draws
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert splitmix64(2 * 0x9E3779B97F4A7C15 % 2**64) == 0x06C45D188009454F
    mults = {(s, layer): layer_multipliers(s, layer, 3) for s in (0, 1) for layer in (0, 1, 2)}
    assert len({tuple(m) for m in mults.values()}) == 6  # every (seed, layer) its own
    assert all(m % 2 == 1 and 0 < m < 2**31 for ms in mults.values() for m in ms)
    assert layer_multipliers(0, 1, 3) == mults[(0, 1)]
    tokens = torch.randint(0, 12, (2, 17))
    make = lambda layer, seed=4: Engram(dim=8, token_map=TOKEN_MAP, layer=layer, seed=seed, heads=4,  # noqa: E731
                                        head_dim=2, rows_per_head=1009)
    a, b = make(2), make(2)
    assert torch.equal(a.hash(tokens), b.hash(tokens))  # two builds, same (seed, layer, tokens): same rows
    assert a.hash.multipliers == layer_multipliers(4, 2, 3)
    for other in (make(3), make(2, seed=5)):  # another layer, another seed: other multipliers, other rows
        assert other.hash.multipliers != a.hash.multipliers
        assert other.hash.head_rows == a.hash.head_rows  # the same table sizes in every layer
        assert not torch.equal(other.hash(tokens), a.hash(tokens))


def test_normalizing_map_on_hand_picked_pieces(tmp_path):
    assert normalize_piece("\u2581The") == "the"  # sentencepiece's word marker, case
    assert normalize_piece("\uff23\uff41\uff46\u00e9") == "cafe"  # full-width forms (NFKC) and an accent
    assert normalize_piece("\ufb01") == "fi"  # the fi ligature (NFKC)
    assert normalize_piece("\u2581\u2581") == normalize_piece("\u2581\t\u3000") == " "  # whitespace runs
    assert normalize_piece("\u2581x\u2581\u2581y\u2581") == "x y"  # collapsed, then stripped
    assert normalize_piece("<0xC3>") == "<0xC3>"  # a byte piece keeps its text (not lowercased)
    assert normalize_piece("\u0301") == "\u0301"  # a lone combining mark would normalize to "": kept
    pieces = ["<unk>", "<s>", "</s>", "<pad>", "<0xC3>", "\u2581The", "the", "\u2581THE", "\u00c9t\u00e9",
              "ete", "\uff23\uff41\uff46\u00e9", "cafe", "\u2581", "\u2581\u2581", "<0xA9>", "\u2581ete"]
    token_map = canonical_map(pieces)
    assert token_map.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 6, 6, 7, 7, 8, 8, 9, 6]
    path = tmp_path / "tok.engram_map.json"
    save_canonical_map(path, token_map)
    assert torch.equal(load_canonical_map(path), token_map)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    body = json.loads(path.read_text())
    assert (body["vocab_size"], body["canonical_vocab"]) == (16, 10)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "reading it failed"),
    (json.dumps({"format": "other", "version": 1, "map": [0]}), "another format"),
    (json.dumps({"format": "memlm-engram-canonical-map", "version": 1, "vocab_size": 3, "map": [0, 1]}),
     "not a list of vocab_size integers"),
    (json.dumps({"format": "memlm-engram-canonical-map", "version": 1, "vocab_size": 2, "map": [0, -1]}),
     "[0, vocab_size)"),
])
def test_a_bad_map_file_is_one_config_error(tmp_path, content, problem):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"token_map=.*map\.json") as err:
        load_canonical_map(path)
    assert problem in str(err.value) and "save_canonical_map" in str(err.value)


def test_causal():
    layer = randomized(Engram(dim=16, token_map=TOKEN_MAP, layer=1, heads=2, head_dim=4, rows_per_head=[7, 11]))
    tokens = torch.randint(0, 12, (2, 24))
    h = torch.randn(2, 24, 16)
    base = layer(h, tokens)
    assert all(TOKEN_MAP[x] != TOKEN_MAP[11 - x] for x in range(12))
    for t in (0, 5, 23):
        tokens2, h2 = tokens.clone(), h.clone()
        tokens2[:, t] = 11 - tokens2[:, t]  # x and 11 - x have different canonical ids, for every x
        h2[:, t] += 1.0
        out = layer(h2, tokens2)
        assert torch.equal(out[:, :t], base[:, :t]), t
        assert not torch.equal(out[:, t], base[:, t]), t
    # A token also moves only its own and later rows
    rows, tokens2 = layer.hash(tokens), tokens.clone()
    tokens2[:, 10] = 11 - tokens2[:, 10]
    changed = (layer.hash(tokens2) != rows).any(-1).any(0)
    assert not changed[:10].any() and changed[10] and not changed[10 + 3:].any()  # orders <= 3: t..t+2


@pytest.mark.parametrize("max_order, kernel_size, dilation", [(3, 4, None), (4, 3, 2), (2, 1, None)])
def test_decoding_with_a_state_equals_the_whole_sequence(max_order, kernel_size, dilation):
    layer = randomized(Engram(dim=16, token_map=TOKEN_MAP, layer=2, max_order=max_order, heads=2, head_dim=4,
                              rows_per_head=7, kernel_size=kernel_size, dilation=dilation))
    tokens = torch.randint(0, 12, (3, 20), generator=torch.Generator().manual_seed(1))
    h = torch.randn(3, 20, 16, generator=torch.Generator().manual_seed(2))
    whole = layer(h, tokens)
    state = layer.new_state(batch=3, max_len=24)
    # A 5-position prompt, a chunk of 3, then one position at a time: each reaches into the state
    cuts = [0, 5, 8, *range(9, 21)]
    steps = [layer(h[:, a:b], tokens[:, a:b], state=state, start=a) for a, b in zip(cuts, cuts[1:])]
    # Every position reads the rows the whole sequence reads (its n-grams reach into the state) ...
    chunk_rows = [layer._rows_after(tokens[:, a:b], state, a) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(chunk_rows, dim=1), layer.hash(tokens))
    # ... and the output is the whole sequence's up to rounding: a matrix product over 3 rows rounds
    # otherwise than one over 60 (BLAS picks another kernel), so W_k e and W_v e differ in the last bits.
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=2e-6)


def test_a_state_rejects_rows_and_positions_past_its_end():
    layer = Engram(dim=8, token_map=TOKEN_MAP, layer=0, heads=2, head_dim=2, rows_per_head=7)
    state, h, tokens = layer.new_state(1, 4), torch.randn(1, 3, 8), torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="start=2 with 3 new positions and a state of 4 is invalid"):
        layer(h, tokens, state=state, start=2)
    with pytest.raises(ValueError, match="tokens= \\(not rows=\\)"):
        layer(h, rows=layer.hash(tokens), state=state)


def test_the_table_is_a_memory_table_and_init_restores_after_to_empty():
    layer = Engram(dim=16, token_map=TOKEN_MAP, layer=1, heads=2, head_dim=4, rows_per_head=[7, 11])
    assert sparse_tables(layer) == [layer.tables.weight]
    dense, tables = split_params(layer)
    assert tables == [layer.tables.weight] and len(dense) == 6
    assert torch.equal(layer.conv, torch.zeros(16, 4))  # zero conv: y = gate * W_v e at step 0
    assert "hash.token_map" in layer.state_dict() and "hash.mult" not in layer.state_dict()
    with torch.device("meta"):
        meta = Engram(dim=16, token_map=TOKEN_MAP, layer=1, heads=2, head_dim=4, rows_per_head=[7, 11])
    meta.to_empty(device="cpu")
    meta.init_weights()
    tokens = torch.randint(0, 12, (2, 9))
    assert torch.equal(meta.hash(tokens), layer.hash(tokens))
    assert torch.equal(meta.conv, layer.conv) and torch.equal(meta.norm_h, layer.norm_h)


def test_signed_sqrt():
    x = torch.tensor([-4.0, -1e-8, 0.0, 1e-8, 2.25], requires_grad=True)
    y = signed_sqrt(x)
    assert y.tolist() == pytest.approx([-2.0, -1e-3, 0.0, 1e-3, 1.5])
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.tolist() == pytest.approx([0.25, 0.0, 0.0, 0.0, 1 / 3])  # flat inside the clamp


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_order=1), "max_order=1 is invalid: an integer in [2, 8]"),
    (dict(max_order=9), "max_order=9 is invalid"),
    (dict(heads=0), "heads=0 is invalid: an integer >= 1"),
    (dict(head_dim=0), "head_dim=0 is invalid: an integer >= 1"),
    (dict(dim=0), "dim=0 is invalid"),
    (dict(kernel_size=0), "kernel_size=0 is invalid"),
    (dict(dilation=0), "dilation=0 is invalid"),
    (dict(layer=-1), "layer=-1 is invalid: an integer >= 0"),
    (dict(seed=-1), "seed=-1 is invalid: an integer in [0, 2**64)"),
    (dict(rows_per_head=1), "rows_per_head=1 is invalid: an integer >= 2 (every order), or one per n-gram "
                            "order 2..3 (2 of them)"),
    (dict(rows_per_head=[7]), "rows_per_head=[7] is invalid"),
    (dict(rows_per_head=[7, 1.5]), "rows_per_head=[7, 1.5] is invalid"),
    (dict(token_map=torch.zeros(2, 3, dtype=torch.int64)), "token_map=(2, 3) is invalid: a non-empty 1-D"),
    (dict(token_map=torch.tensor([0, -1])), "token_map holds ids in [-1, 0]"),
])
def test_bad_sizes_are_clear_errors(kwargs, message):
    args = dict(dim=8, token_map=TOKEN_MAP, layer=0, heads=2, head_dim=2, rows_per_head=7) | kwargs
    with pytest.raises(ValueError) as err:
        Engram(**args)
    assert message in str(err.value)


def test_bad_inputs_are_clear_errors():
    layer = Engram(dim=8, token_map=TOKEN_MAP, layer=0, heads=2, head_dim=2, rows_per_head=7)
    h, tokens = torch.randn(2, 5, 8), torch.randint(0, 12, (2, 5))
    with pytest.raises(ValueError, match=r"token ids in \[12, 12\] are invalid: ids in \[0, 12\)"):
        layer(h, torch.full((2, 5), 12))
    with pytest.raises(ValueError, match=r"token ids in \[-1, 0\] are invalid"):
        layer(h, torch.tensor([[-1, 0, 0, 0, 0]] * 2))
    with pytest.raises(ValueError, match=r"tokens of shape \(10,\) .* are invalid: \(batch, seq\)"):
        layer.hash(tokens.flatten())
    with pytest.raises(ValueError, match="exactly one of tokens="):
        layer(h, tokens, rows=layer.hash(tokens))
    with pytest.raises(ValueError, match="exactly one of tokens="):
        layer(h)
    with pytest.raises(ValueError, match=r"h \(2, 5, 7\) with rows \(2, 5, 4\) is invalid: h \(B, T, dim=8\)"):
        layer(torch.randn(2, 5, 7), tokens)
    with pytest.raises(ValueError, match=r"rows \(2, 4, 4\) is invalid"):
        layer(h, tokens[:, :4])
    with pytest.raises(ValueError, match=r"pieces=\[\] is invalid"):
        canonical_map([])
