"""Does the tiny model learn log-search's two copies from demonstrations? A fast CPU probe (issue 48, item 1).

Supervised training of the tiny Llama (HF ``LlamaForCausalLM`` of ``make_tiny_model``, the architecture the trainer
converts) on the task's demonstrated transcripts (``demonstration_tokens``: loss on action tokens only, as the warm
start), then teacher-forced argmax accuracy on held-out worlds of the real task of the two copies: the ``grep``
argument (the id, from the end-of-logs marker) and the ``<answer>`` digits (from the grep result). A whole
demonstrated transcript is right under greedy decoding only if both are, so ``both`` bounds greedy success.

    python tools/log_search_copy_probe.py --phases short:300,full:100 --lr 3e-3

``--phases KIND:STEPS,...``: SFT phases in order, KIND ``tiny`` (one page of 2 lines), ``short`` (one page of 8
lines) or ``full`` (the task's worlds). Not a benchmark: a probe for choosing the warm start; its numbers are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch


KINDS = {"tiny": dict(short_frac=1.0, page_lines=2), "short": dict(short_frac=1.0), "full": dict(short_frac=0.0)}


def _examples(task, codec, split, step, n, seed, kind):
    from megatron_tsync.training.sft import demonstration_tokens

    t = dataclasses.replace(task, **KINDS[kind])
    return [demonstration_tokens(codec, t.demonstration_segments(i)) + (i,)
            for i in t.sample_prompts(step, n, seed, split=split)]


def _copy_positions(codec, ids, inst):
    """Target positions (indices into ids) of the grep id's tokens and the answer's digits."""
    world = inst.meta["world"]
    grep = codec.encode(f"<tool>grep: {world.key}</tool>")
    ans = codec.encode(f"<answer>{world.code}</answer>")
    out = {}
    for name, pat, core in (("grep", grep, slice(-1 - len(codec.encode(world.key)), -1)),
                            ("answer", ans, slice(1, -1))):
        for s in range(len(ids) - len(pat), -1, -1):
            if ids[s:s + len(pat)] == pat:
                idx = list(range(s, s + len(pat)))[core]
                out[name] = idx
                break
    return out


def evaluate(model, task, codec, n, seed, kind="full"):
    hits = {"grep": 0, "answer": 0, "both": 0}
    exs = _examples(task, codec, "eval", 0, n, seed + 7, kind)
    with torch.no_grad():
        for ids, _mask, inst in exs:
            pos = _copy_positions(codec, ids, inst)
            logits = model(torch.tensor([ids])).logits[0]
            ok = {k: all(int(logits[p - 1].argmax()) == ids[p] for p in v) for k, v in pos.items()}
            for k in ("grep", "answer"):
                hits[k] += ok[k]
            hits["both"] += ok["grep"] and ok["answer"]
    return {k: v / n for k, v in hits.items()}


def main() -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.runtime.env_tasks import LogSearchTask
    from megatron_tsync.training.sft import collate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="full:150")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--code-digits", type=int, default=2)
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--dir", default="/tmp/log_search_probe_model")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    make_tiny_model(a.dir, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, seed=a.seed)
    codec = TokenizerCodec(AutoTokenizer.from_pretrained(a.dir))
    model = LlamaForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32)
    task = LogSearchTask(code_digits=a.code_digits)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    t0, k = time.time(), 0
    for phase in a.phases.split(","):
        kind, steps = phase.split(":")
        for _ in range(int(steps)):
            exs = _examples(task, codec, "train", k, a.batch, a.seed, kind)
            ids, mask = collate([e[:2] for e in exs], pad_id=0)
            logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
            nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            k += 1
            if k % a.eval_every == 0:
                model.eval()
                ev = {kd: evaluate(model, task, codec, a.eval_n if kd == "full" else 32, a.seed, kd) for kd in KINDS}
                model.train()
                txt = " ".join(f"{kd} {r['grep']:.2f}/{r['answer']:.2f}/{r['both']:.2f}" for kd, r in ev.items())
                print(f"step {k} ({kind}) loss {loss.item():.4f} held-out grep/answer/both {txt} "
                      f"t={time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
