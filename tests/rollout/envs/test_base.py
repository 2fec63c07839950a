"""The environment protocol inside the real agent loop: a swe-lite episode in Qwen's tool-call format, token in /
token out (the generated ids are kept exactly as sampled, even when they are not the tokenizer's own spelling;
observations are appended as tokens with loss mask 0), submit ends the trajectory, and the verdict is the reward.
The calculator task runs as an environment too."""

from __future__ import annotations

import asyncio

import pytest

from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop
from megatron_tsync.rollout.engine import Completion, SamplingConfig
from megatron_tsync.rollout.envs import available_environments
from megatron_tsync.rollout.envs.base import EnvTools
from megatron_tsync.rollout.envs.swe_lite import SweLiteEnv, generate_task

pytestmark = pytest.mark.timeout(120)

SPECIALS = ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>",
            "</tool>", "<result>", "</result>", "</s>")


class ByteCodec:
    """Bytes are ids 0..255; each special string is one id 256+ (like a chat tokenizer's added tokens)."""

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for k, s in enumerate(SPECIALS):
                if text.startswith(s, i):
                    out.append(256 + k)
                    i += len(s)
                    break
            else:
                out.extend(text[i].encode())
                i += 1
        return out

    def encode_text(self, text: str) -> list[int]:  # plain text: no special string is matched
        return list(text.encode())

    def decode(self, ids) -> str:
        data, out = bytearray(), []
        for t in ids:
            if t >= 256:
                out.append(data.decode("utf-8", "replace") + SPECIALS[t - 256])
                data = bytearray()
            else:
                data.append(t)
        return "".join(out) + data.decode("utf-8", "replace")


class ScriptedEngine:
    """Turn k of every trajectory returns ``turns[k]`` (token ids), cut after the first tool token."""

    def __init__(self, turns, tool_id):
        self.turns, self.tool_id, self.calls = turns, tool_id, {}

    policy_version = 5

    def generate(self, prompts, sampling, n=1, seeds=None):
        outs = []
        for p in prompts:
            k = self.calls.get(p[0], 0)
            self.calls[p[0]] = k + 1
            ids = list(self.turns[k])
            reason = "stop"
            if self.tool_id in ids:
                ids, reason = ids[: ids.index(self.tool_id) + 1], "tool"
            outs.append([Completion(ids, [-0.25] * len(ids), reason, policy_version=5)])
        return outs

    def update_weights(self, state, version):  # pragma: no cover
        pass


def test_qwen_tool_calls_token_in_token_out(env_sandbox, hidden_verifier):
    codec = ByteCodec()
    env = SweLiteEnv(sandbox=env_sandbox, verifier=hidden_verifier, tool_format="qwen")
    task = generate_task(0, 2)
    texts = ["Let me look.\n" + env.format.render_call("bash", {"command": "ls -R"}),
             *env.render_solution(task)]
    turns = [codec.encode(t) for t in texts]
    turns[0] = list(b"Let me look.\n")  # <tool_call> spelled in bytes, not as its token
    turns[0] = turns[0] + list(b"<tool_call>") + codec.encode(texts[0])[len(b"Let me look.\n") + 1:]
    assert codec.encode(codec.decode(turns[0])) != turns[0]  # re-tokenising would change the ids
    tool_id = codec.encode("</tool_call>")[0]

    async def go():
        ep = await env.start(task)
        loop = AgentLoop(ScriptedEngine(turns, tool_id), codec,
                         AgentConfig(SamplingConfig(max_new_tokens=4096, stop_token_ids=(codec.encode("</s>")[0],),
                                                    tool_token_ids=(tool_id,)), max_turns=8, max_total_tokens=20000),
                         tools=EnvTools())
        (traj,) = await loop.run_async([codec.encode(ep.prompt)], metadata=[{"episode": ep}])
        verdict = await ep.finish(codec.decode(traj.token_ids))
        return traj, verdict

    traj, verdict = asyncio.run(go())
    assert traj.finish_reason == "done" and traj.num_turns == 3 and verdict.reward == 1.0, (traj.finish_reason, verdict)
    for (start, end), want in zip(traj.turn_spans, turns):
        assert traj.token_ids[start:end] == want  # exactly the sampled ids
        assert traj.loss_mask[start:end] == [1] * len(want) and traj.logprobs[start:end] == [-0.25] * len(want)
    for rec in traj.tool_calls:
        s, e = rec.result_span
        assert traj.loss_mask[s:e] == [0] * (e - s) and traj.logprobs[s:e] == [0.0] * (e - s)
        obs = codec.decode(traj.token_ids[s:e])
        assert obs.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n")
        assert obs.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "edited" in codec.decode(traj.token_ids[slice(*traj.tool_calls[1].result_span)])
    assert sum(traj.loss_mask) == sum(len(t) for t in turns)


def test_calculator_task_as_an_environment(env_sandbox):
    from megatron_tsync.rollout.envs.base import run_scripted
    from megatron_tsync.rollout.envs.calculator import CalculatorEnv
    from megatron_tsync.runtime.tasks import ArithmeticCalculatorTask

    assert {"calculator", "swe-lite", "terminal-lite", "workspace"} <= set(available_environments())
    task = ArithmeticCalculatorTask()
    inst = task.instance("37+18*4")
    env = CalculatorEnv(env_sandbox)
    segs = task.demonstration_segments(inst)
    verdict, (obs,) = asyncio.run(run_scripted(env, inst, [segs[1][0]]))
    assert obs.text == segs[2][0] == "<result>109</result>"  # the tool output the demonstration expects

    async def finish(text):
        ep = await env.start(inst)
        return await ep.finish(text)

    assert asyncio.run(finish("".join(s for s, _ in segs[1:]))).reward == 1.0
    assert asyncio.run(finish(segs[1][0] + segs[2][0] + "<answer>110</answer>")).reward == 0.0
