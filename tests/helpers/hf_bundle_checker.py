"""What a user's plain transformers code gets from a memlm export (no memlm import: runs in any venv).

    python tests/helpers/hf_bundle_checker.py EXPORT_DIR CASES.json OUT.json

CASES.json: {"texts": [...], "tokens": [[id, ...], ...], "prompts": [...], "max_new_tokens": N}.
OUT.json gets, from `AutoTokenizer` (trust_remote_code=False) / `AutoModelForCausalLM`
(trust_remote_code=True) alone:
the ids of every text with and without special tokens, their decodes, the special ids,
the logits of the token rows, and greedy `generate()` continuations of the prompts (new
tokens, the final eos dropped). tests/integration/test_hf_bundle.py compares them with memlm, under
transformers 5 in-process and under 4.x through MEMLM_TF4_PYTHON.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers


def check(export_dir: str, cases: dict) -> dict:
    # The lines docs/checkpoints.md shows: the tokenizer needs no code (False: transformers 5 would
    # otherwise ask whether to run the config's custom code first), the model of a non-dense export does.
    tok = transformers.AutoTokenizer.from_pretrained(export_dir, trust_remote_code=False)
    out = {
        "transformers": transformers.__version__,
        "tokenizer_class": type(tok).__name__,
        "special": {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id},
        "with_special": [tok(t).input_ids for t in cases["texts"]],
        "plain": [tok(t, add_special_tokens=False).input_ids for t in cases["texts"]],
    }
    out["decoded"] = [tok.decode(ids, skip_special_tokens=True) for ids in out["with_special"]]
    if not cases.get("tokens") and not cases.get("prompts"):
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True).float().eval()
    gen = model.generation_config
    out["generation_config"] = {"do_sample": gen.do_sample, "eos": gen.eos_token_id, "pad": gen.pad_token_id}
    with torch.no_grad():
        if cases.get("tokens"):
            out["logits"] = model(torch.tensor(cases["tokens"])).logits.tolist()  # (batch, seq, vocab)
        generated = []
        for prompt in cases.get("prompts", []):
            enc = tok(prompt, return_tensors="pt")  # eos first: the bundle's add_bos_token
            # Nothing but max_new_tokens: greedy and the stop token come from generation_config.json.
            ids = model.generate(**enc, max_new_tokens=cases["max_new_tokens"])[0, enc.input_ids.shape[1]:].tolist()
            generated.append(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)
        out["generated"] = generated
        out["answers"] = [tok.decode(ids) for ids in generated]
    return out


def main(argv: list[str]) -> int:
    export_dir, cases, out = argv
    with open(cases, encoding="utf-8") as fh:
        result = check(export_dir, json.load(fh))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
