"""Make the agent loop's markers single tokens of a Hugging Face tokenizer (in place, or into --out).

    python examples/add_agent_tokens.py --model /models/Qwen2.5-Coder-7B-Instruct [--out DIR]

The agent loop stops a turn on the token ids of ``</tool>`` and ``</answer>`` (``runtime/worker.py``), so those markers
must each be one token. Qwen2.5's tokenizer splits them into several. This adds ``<tool>``, ``</tool>``, ``<result>``,
``</result>``, ``<answer>``, ``</answer>`` as ordinary added tokens (decoded as text, not skipped as special) and checks
that the new ids fit the model's embedding (Qwen2.5 pads ``vocab_size`` to 152064 > 151665 tokenizer entries, so no
resize is needed; the rows are untrained: a supervised warm start, ``--sft-warmup-steps``, teaches the format).
Only tokenizer files are written; with ``--out`` the other files of the folder are symlinked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MARKERS = ["<tool>", "</tool>", "<result>", "</result>", "<answer>", "</answer>"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--out", default=None, help="write here instead of in place (other files symlinked)")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    added = tok.add_tokens([m for m in MARKERS if len(tok.encode(m, add_special_tokens=False)) != 1])
    with open(os.path.join(a.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    ids = {m: tok.convert_tokens_to_ids(m) for m in MARKERS}
    if len(tok) > vocab:
        raise SystemExit(f"tokenizer has {len(tok)} entries > the model's vocab_size {vocab}: resize the embedding "
                         "first")
    out = a.out or a.model
    if a.out:
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(a.model):
            if not name.startswith("tokenizer") and name not in ("special_tokens_map.json", "added_tokens.json",
                                                                  "vocab.json", "merges.txt"):
                dst = os.path.join(out, name)
                if not os.path.exists(dst):
                    os.symlink(os.path.abspath(os.path.join(a.model, name)), dst)
    tok.save_pretrained(out)
    print(f"added {added} tokens; ids {ids}; tokenizer {len(tok)} <= vocab_size {vocab}; written to {out}")
    return ids


if __name__ == "__main__":
    main(sys.argv[1:])
