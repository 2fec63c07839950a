"""Success rate of a checkpoint on held-out prompts of the tiny agent task, with the real rollout stack.

    python examples/tiny_agent/evaluate.py --hf-dir runs/tiny/hf            # a Hugging Face folder
    python examples/tiny_agent/evaluate.py --load runs/tiny/ckpt            # a megatron checkpoint (latest step)

The policy runs in the embedded Megatron engine, the agent loop drives the turns, every ``calculator`` call runs in
the sandbox, and the ``exact_answer`` verifier scores the final text. Prompts come from the task's ``eval`` split
(disjoint from training prompts). Prints one JSON line: success rate, its standard error, tool-use and format rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def agent_config(codec, *, temperature: float = 1.0, seed: int | None = 0, max_new_tokens: int = 32,
                 max_turns: int = 3, max_total_tokens: int = 128):
    """The agent-loop limits of the tiny task: turns end at ``</tool>``; ``</answer>`` or ``</s>`` stop."""
    from megatron_tsync.rollout.agent_loop import AgentConfig
    from megatron_tsync.model.tokenizer import tag_token_id
    from megatron_tsync.rollout.engine import SamplingConfig

    sampling = SamplingConfig(
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        stop_token_ids=(tag_token_id(codec, "</s>"), tag_token_id(codec, "</answer>")),
        tool_token_ids=(tag_token_id(codec, "</tool>"),),
        seed=seed,
    )
    return AgentConfig(sampling=sampling, max_turns=max_turns, max_total_tokens=max_total_tokens,
                       max_result_tokens=32)


def rollout_and_score(engine, codec, task, instances, *, samples: int = 1, temperature: float = 1.0,
                      seed: int = 0, tools=None):
    """Roll out ``samples`` trajectories per instance and score them; returns (trajectories, rewards, texts)."""
    from megatron_tsync.rollout.agent_loop import AgentLoop
    from megatron_tsync.rollout.verifiers import get_verifier

    cfg = agent_config(codec, temperature=temperature, seed=seed)
    loop = AgentLoop(engine, codec, cfg, tools=tools)
    prompts = [codec.encode(inst.prompt_text) for inst in instances for _ in range(samples)]
    trajs = loop.run(prompts)
    texts = [codec.decode(t.token_ids) for t in trajs]
    verifier = get_verifier(task.verifier, **task.verifier_kwargs)

    async def score_all():
        return await asyncio.gather(*(
            verifier.score(text, instances[i // samples].verifier_task()) for i, text in enumerate(texts)))

    rewards = asyncio.run(score_all())
    return trajs, rewards, texts


def evaluate(engine, codec, task, *, num_prompts: int = 200, samples: int = 1, temperature: float = 1.0,
             seed: int = 0, tools=None) -> dict:
    """Success metrics on ``num_prompts`` eval-split prompts (a pure function of ``seed``)."""
    insts = task.sample_prompts(0, num_prompts, seed, split="eval")
    t0 = time.perf_counter()
    trajs, rewards, texts = rollout_and_score(engine, codec, task, insts, samples=samples, temperature=temperature,
                                              seed=seed, tools=tools)
    n = len(rewards)
    success = sum(1 for r in rewards if r >= 1.0) / n
    used_tool = sum(1 for t in trajs if any(c.ok for c in t.tool_calls)) / n
    answered = sum(1 for x in texts if "</answer>" in x) / n
    return {
        "success_rate": success,
        "stderr": math.sqrt(success * (1 - success) / n),
        "mean_reward": sum(rewards) / n,
        "tool_use_rate": used_tool,
        "answer_rate": answered,
        "num_trajectories": n,
        "rollout_s": round(time.perf_counter() - t0, 2),
        "example": texts[0],
    }


def load_engine(args):
    """(engine, codec) from an HF folder or a megatron checkpoint (+ the tokenizer of ``--tokenizer`` or its
    ``hf_assets``)."""
    from tokenizers import Tokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.model.parallel import initialize_parallel

    if "MASTER_PORT" not in os.environ:  # a private single-process group: any free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    initialize_parallel(1, 1, seed=args.seed)
    if args.hf_dir:
        engine = EmbeddedEngine.from_hf_dir(args.hf_dir)
        tok_dir = args.tokenizer or args.hf_dir
    else:
        from megatron_tsync.training.checkpointing import arch_from_checkpoint, load_checkpoint
        from megatron_tsync.model.builder import build_model

        model = build_model(arch_from_checkpoint(args.load), seed=0)
        if load_checkpoint(args.load, model, load_rng=False) is None:
            raise SystemExit(f"no checkpoint in {args.load}")
        engine = EmbeddedEngine(model)
        tok_dir = args.tokenizer or os.path.join(args.load, "hf_assets")
    return engine, TokenizerCodec(Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="Hugging Face folder (weights + tokenizer)")
    src.add_argument("--load", help="megatron checkpoint directory (latest step)")
    p.add_argument("--tokenizer", help="folder with tokenizer.json (default: the HF dir / the checkpoint's hf_assets)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--task", default="arithmetic-calculator")
    p.add_argument("--min-operands", type=int, default=None)
    p.add_argument("--max-operands", type=int, default=None)
    p.add_argument("--max-value", type=int, default=None)
    args = p.parse_args(argv)

    import torch

    from megatron_tsync.runtime.tasks import get_task

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    kw = {k: v for k, v in (("min_operands", args.min_operands), ("max_operands", args.max_operands),
                            ("max_value", args.max_value)) if v is not None}
    task = get_task(args.task, **kw)
    engine, codec = load_engine(args)
    out = evaluate(engine, codec, task, num_prompts=args.num_prompts, samples=args.samples_per_prompt,
                   temperature=args.temperature, seed=args.seed)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
