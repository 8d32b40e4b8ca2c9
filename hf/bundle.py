"""The Hugging Face side files of an export: tokenizer, generation defaults, a portable config.json.

    from memlm.hf.bundle import write_hf_side_files, hf_token_ids, portable_config_json
    write_hf_side_files(out_dir, "tok.model", model_max_length=2048)
    # -> tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json
    LlamaConfig(..., **hf_token_ids("tok.model")).save_pretrained(out_dir)   # bos = eos = 2, pad = 3
    portable_config_json(out_dir / "config.json", rope_theta)                # top-level rope_theta for 4.x

`train.export` calls these for every export (dense and memory kinds), so plain
`transformers.AutoTokenizer.from_pretrained(out_dir, trust_remote_code=False)`
gives memlm's token ids under transformers 4.4x and 5.x alike, and `generate()`
stops where memlm does. The tokenizer is a built-in class (`tokenizer_class`
below; no tokenizer in any `auto_map`), so it never needs the export's code;
`False` matters for Memory/MoE/PEER exports under transformers 5, whose
AutoTokenizer first reads config.json and would otherwise ask whether to run
its custom config code (docs/checkpoints.md, "The export in plain transformers code").

The tokenizer: `tokenizer.json` is a byte-fallback BPE built here from the
sentencepiece model (pieces, ids and scores read from its protobuf; no
`transformers` or `tokenizers` install needed to write it). sentencepiece's BPE
merges, at each step, the adjacent pair whose concatenation is the
highest-scoring piece (scores are distinct), on the whole text with no
pre-splitting; the equivalent `tokenizers` BPE has one merge (left, right) for
every split of every normal piece into two normal pieces, ranked by the merged
piece's score. A space is the "▁" character (a normalizer), the tokenizer
adds no dummy prefix (memlm's models are trained without one) and characters
outside the vocabulary fall back to their UTF-8 byte pieces, as in sentencepiece.

The start token: memlm starts every prompt with eos, because in packed
training data every document follows an eos (evals/decoding.py). The bundle
says so by declaring `</s>` as the bos token too (`bos_token = eos_token =
"</s>"`, GPT-2 style) with `add_bos_token: true`: `tokenizer(text)` gives
`[eos, *memlm_ids(text)]`, exactly memlm's prompt; `add_special_tokens=False`
gives memlm's plain `Tokenizer.encode(text)`. `<s>` (id 1) stays in the
vocabulary but memlm never uses it. `split_special_tokens: true` makes a
literal "</s>" inside a text encode as text, as sentencepiece does.
"""

from __future__ import annotations

import json
from pathlib import Path

from memlm.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
SPACE = "\u2581"  # sentencepiece's visible space "▁"

# sentencepiece ModelProto.SentencePiece.Type and TrainerSpec.ModelType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE = 2
SPECIAL_TYPES = (CONTROL, UNKNOWN)  # never produced from text by sentencepiece: added tokens for tokenizers


def _load_proto(path: str | Path):
    from sentencepiece import sentencepiece_model_pb2  # needs protobuf (a wandb dependency)

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as err:  # protobuf's DecodeError names no file
        raise ConfigError("tokenizer", str(path), f"a sentencepiece .model file ({err})") from None
    return proto


def _check_convertible(proto, path: str | Path) -> None:
    """Refuse what the converted tokenizer would encode differently (a named setting, its value, what works)."""
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    what = "a BPE sentencepiece model with identity normalization (as python -m memlm.data.tokenizer trains)"
    if trainer.model_type != BPE:
        raise ConfigError(f"tokenizer {path}: trainer_spec.model_type", trainer.model_type, what)
    if norm.precompiled_charsmap or norm.name not in ("identity", ""):
        raise ConfigError(f"tokenizer {path}: normalizer_spec.name", norm.name, what)
    if norm.remove_extra_whitespaces:
        raise ConfigError(f"tokenizer {path}: normalizer_spec.remove_extra_whitespaces", True, f"false in {what}")
    if not norm.escape_whitespaces or trainer.treat_whitespace_as_suffix:
        raise ConfigError(f"tokenizer {path}: normalizer_spec.escape_whitespaces / treat_whitespace_as_suffix",
                          (norm.escape_whitespaces, trainer.treat_whitespace_as_suffix), "(true, false)")
    user = [p.piece for p in proto.pieces if p.type == USER_DEFINED]
    if user:
        raise ConfigError(f"tokenizer {path}: user-defined pieces", user[:5], f"none in {what}")


def _special(proto, index: int) -> str | None:
    return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None


def hf_token_ids(path: str | Path | None) -> dict[str, int]:
    """The ids config.json and generation_config.json declare: bos (= eos, memlm's start token; see the
    module doc), eos and pad (when the model has one). No tokenizer: none (transformers' defaults)."""
    if path is None:
        return {}
    trainer = _load_proto(path).trainer_spec
    ids = {"bos_token_id": trainer.eos_id, "eos_token_id": trainer.eos_id, "pad_token_id": trainer.pad_id}
    return {k: v for k, v in ids.items() if v >= 0}


def merges(proto) -> list[list[str]]:
    """Every (left, right) split of a normal piece into two normal pieces, best merged piece first."""
    mergeable = {p.piece: p.score for p in proto.pieces if p.type == NORMAL}
    ranked = []
    for order, piece in enumerate(p.piece for p in proto.pieces if p.type == NORMAL):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-mergeable[piece], order, cut, [left, right]))
    ranked.sort(key=lambda r: r[:3])
    return [pair for *_, pair in ranked]


def _added(content: str, index: int) -> dict:
    return {"id": index, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer_json(path: str | Path) -> dict:
    """The `tokenizers` serialization (format 1.0) equivalent to the sentencepiece model at `path`."""
    proto = _load_proto(path)
    _check_convertible(proto, path)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    eos, unk = _special(proto, trainer.eos_id), _special(proto, trainer.unk_id)
    if eos is None:
        raise ConfigError(f"tokenizer {path}: trainer_spec.eos_id", trainer.eos_id, "the id of an eos piece")
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if norm.add_dummy_prefix:  # not memlm's models; kept exact for other BPE sentencepiece files
        normalizers.insert(0, {"type": "Prepend", "prepend": SPACE})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    start = {"SpecialToken": {"id": eos, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added(p.piece, i) for i, p in enumerate(proto.pieces) if p.type in SPECIAL_TYPES],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [start, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [start, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": eos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {eos: {"id": eos, "ids": [trainer.eos_id], "tokens": [eos]}},
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": bool(trainer.byte_fallback),
            "ignore_merges": False,
            "vocab": {p.piece: i for i, p in enumerate(proto.pieces)},
            "merges": merges(proto),
        },
    }


def tokenizer_config(path: str | Path, model_max_length: int) -> dict:
    """tokenizer_config.json: a plain fast tokenizer over tokenizer.json, with memlm's start token."""
    proto = _load_proto(path)
    trainer = proto.trainer_spec
    eos = _special(proto, trainer.eos_id)
    return {
        # Not LlamaTokenizer(Fast): those rebuild the pre-tokenizer with a prefix space under transformers 5.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos,
        "eos_token": eos,
        "unk_token": _special(proto, trainer.unk_id),
        "pad_token": _special(proto, trainer.pad_id),
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",  # batched generate: prompts end where generation starts
        # 4.x's PreTrainedTokenizerFast also returns token_type_ids, which generate(**enc) refuses.
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "added_tokens_decoder": {str(i): {k: v for k, v in _added(p.piece, i).items() if k != "id"}
                                 for i, p in enumerate(proto.pieces) if p.type in SPECIAL_TYPES},
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path, tokenizer_path: str | Path, model_max_length: int) -> list[str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json next to the copied tokenizer.model."""
    out_dir = Path(out_dir)
    config = tokenizer_config(tokenizer_path, model_max_length)
    _write_json(out_dir / TOKENIZER_JSON, tokenizer_json(tokenizer_path))
    _write_json(out_dir / TOKENIZER_CONFIG, config)
    _write_json(out_dir / SPECIAL_TOKENS_MAP,
                {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config[k]})
    return [TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP]


def write_generation_config(out_dir: Path, tokenizer_path: str | Path | None) -> str:
    """generation_config.json: greedy by default (memlm's decoding), stopping at eos, padding with pad."""
    _write_json(Path(out_dir) / GENERATION_CONFIG, {**hf_token_ids(tokenizer_path), "do_sample": False, "num_beams": 1})
    return GENERATION_CONFIG


def write_hf_side_files(out_dir: Path, tokenizer_path: str | Path | None, model_max_length: int) -> list[str]:
    """Every export's Hugging Face files besides weights and config.json: the tokenizer files (when the
    run has a tokenizer) and generation_config.json."""
    written = write_tokenizer_files(out_dir, tokenizer_path, model_max_length) if tokenizer_path else []
    return [*written, write_generation_config(out_dir, tokenizer_path)]


def portable_config_json(path: Path, rope_theta: float) -> None:
    """Make a config.json written by transformers 5 readable by 4.x: 5 keeps rope_theta only inside
    `rope_parameters`, and 4.x then silently uses its default 10000."""
    config = json.loads(Path(path).read_text())
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError("config.json rope_parameters.rope_type", rope.get("rope_type"), "default (plain RoPE)")
    config["rope_theta"] = float(rope_theta)
    _write_json(Path(path), config)
