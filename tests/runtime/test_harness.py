"""Harness-driven training (``runtime/harness.py``): the rollout worker serves the OpenAI-compatible endpoint and runs
a harness command per episode (``tests/runtime/harness_cases.py``: the real ``openai`` client), in a real training
run (``python -m megatron_tsync.train``, a worker process, signed events, float64).

- bad harness behaviour: a crash, a hang past ``--harness-timeout``, malformed JSON, no finish and an off-spec reward
  each give one failed trajectory counted under its reason in the step's log row; the step completes with every
  trajectory accounted for and nothing rejected;
- the trained token ids and log-probs are the ones the engine sampled (what each completion response said);
- the step trained from the harness episodes (stream-trajectory) equals the same episodes replayed with
  ``--replay-rollouts`` in sync mode: gradients ≤ 1e-12 relative in float64;
- the example (``examples/openai_harness``, ``--harness-fn``) drives the warm-started tiny agent through the endpoint:
  tool calls, tool results, the verifier's reward, no failure.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--group-size", "2", "--global-batch-size", "8", "--max-new-tokens", "12", "--seq-length", "96",
          "--params-dtype", "float64", "--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0", "--train-iters", "1",
          "--no-progress", "--harness-chat-format", "tag"]


def _train(args, cwd, extra_env=None, timeout=900):
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def harness_run(tiny_dir, tmp_path_factory):
    """One live step driven by tests/runtime/harness_cases.py (4 groups x 2: six misbehaving episodes)."""
    tmp = tmp_path_factory.mktemp("harness")
    rec = tmp / "record"
    rec.mkdir()
    out = _train(["--model", tiny_dir, *COMMON, "--rl-mode", "stream-trajectory", "--rollout-workers", "1",
                  "--harness-cmd", f"{sys.executable} {os.path.join(ROOT, 'tests', 'runtime', 'harness_cases.py')}",
                  "--harness-timeout", "30", "--save", str(tmp / "ck"), "--dump-rollouts", str(tmp / "dump"),
                  "--dump-grads", str(tmp / "g_live")], ROOT, {"TSYNC_TEST_RECORD": str(rec)})
    return tmp, out


@pytest.mark.slow
def test_bad_harness_behaviour_is_counted_and_the_step_completes(harness_run):
    tmp, out = harness_run
    (row,) = json.loads((tmp / "ck" / "history.json").read_text())
    assert {k: row[k] for k in row if k.startswith("harness_")} == {
        "harness_crash": 1, "harness_timeout": 1, "harness_bad_request": 1, "harness_no_finish": 1,
        "harness_bad_reward": 1}, row
    assert row["trajectories"] == 8 and row["ledger_used"] == 8 and row["events_rejected"] == 0
    assert "boom: the harness crashed" in out  # the crash's stderr tail is in the failure message
    from megatron_tsync.runtime.rollout_io import load_rollouts

    samples, _ = load_rollouts(str(tmp / "dump"), 0)
    fail = {s.traj_id: s.meta.get("harness_fail") for s in samples}
    assert fail == {"s0g0t0": "harness_crash", "s0g0t1": "harness_timeout", "s0g1t0": "harness_bad_request",
                    "s0g1t1": "harness_no_finish", "s0g2t0": None, "s0g2t1": "harness_bad_reward", "s0g3t0": None,
                    "s0g3t1": None}
    rewards = {s.traj_id: s.reward for s in samples}
    assert rewards["s0g2t0"] == rewards["s0g3t0"] == 1.0 and rewards["s0g2t1"] == 0.0  # the harness's / the floor


@pytest.mark.slow
def test_trained_tokens_are_sampled_and_replay_sync_equals_live_float64(harness_run, tiny_dir):
    tmp, _ = harness_run
    from megatron_tsync.runtime.rollout_io import load_rollouts

    samples, _ = load_rollouts(str(tmp / "dump"), 0)
    checked = 0
    for s in samples:
        path = tmp / "record" / f"{s.traj_id}.json"
        if s.meta.get("harness_fail"):  # failed: trained on nothing (its mask is zero)
            continue
        (turn,) = json.loads(path.read_text())
        on = s.loss_mask.numpy() == 1
        assert s.token_ids.numpy()[on].tolist() == turn["ids"] and len(turn["ids"]) > 0
        assert np.array_equal(s.behaviour_logp.numpy()[on].astype(np.float32), np.float32(turn["logprobs"]))
        checked += 1
    assert checked == 3  # the episodes that finished and were scored (g2t0, g3t0, g3t1)
    _train(["--model", tiny_dir, *COMMON, "--rl-mode", "sync", "--rollout-workers", "0", "--replay-rollouts",
            str(tmp / "dump"), "--dump-grads", str(tmp / "g_replay")], ROOT)
    from safetensors.torch import load_file

    a = load_file(str(tmp / "g_live" / "grad_step_0000000.safetensors"))
    b = load_file(str(tmp / "g_replay" / "grad_step_0000000.safetensors"))
    assert set(a) == set(b)
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in a) ** 0.5
    den = sum(float(a[n].pow(2).sum()) for n in a) ** 0.5
    assert den > 0 and num / den < 1e-12, num / den


@pytest.mark.slow
def test_example_agent_drives_the_tiny_agent(tmp_path):
    """examples/openai_harness as configured (--harness-fn: the agent as coroutines in the worker), one step of 2
    prompts x 8 after the warm start: the calculator runs as an OpenAI tool, the episodes' requests share engine
    calls, nothing fails. The episodes score themselves the documented way (tests/runtime/parsing_harness.py: the
    example's conversation, the last ``<answer>...</answer>`` of the final reply's content): the warm-started agent's
    correct answers get reward 1 (with the stop string stripped from the content, as before issue 50, every reward
    was 0), and every reward equals the task's own verifier on the trained transcript."""
    ck, dump = tmp_path / "ck", tmp_path / "dump"
    _train(["--config", os.path.join(ROOT, "examples", "openai_harness", "config.yaml"), "--model",
            str(tmp_path / "model"), "--init-tiny-model", "--train-iters", "1", "--global-batch-size", "16", "--eval-interval", "0",
            "--harness-fn", "tests.runtime.parsing_harness:run_episode",
            "--save", str(ck), "--dump-rollouts", str(dump), "--no-progress"], ROOT)
    (row,) = json.loads((ck / "history.json").read_text())
    assert all(row[f"harness_{r}"] == 0 for r in ("crash", "timeout", "bad_request", "no_finish", "bad_reward"))
    assert row["trajectories"] == 16 and row["success_rate"] > 0, row
    import asyncio
    import re

    from transformers import AutoTokenizer

    from megatron_tsync.rollout.verifiers import get_verifier
    from megatron_tsync.runtime.rollout_io import load_rollouts
    from tests.runtime.parsing_harness import calculator

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    samples, _ = load_rollouts(str(dump), 0)
    texts = [tok.decode(s.token_ids.tolist()) for s in samples]
    assert any("</tool><result>" in t and "<answer>" in t for t in texts), texts[:4]  # a tool turn, then the answer
    verifier = get_verifier("exact_answer")
    for s, text in zip(samples, texts):
        prompt, generated = re.match(r"<s>Q: (\S+) (.*)", text, re.DOTALL).groups()
        want = {"answer": int(calculator(prompt))}
        assert s.reward == asyncio.run(verifier.score(generated, want)), (s.reward, text)
    assert sum(s.reward for s in samples) > 0
    log = (ck / "rollout_plane" / "worker_logs" / "worker0.log").read_text()
    line = next(ln for ln in log.splitlines() if "harness step 0: 16 episodes" in ln)
    assert float(line.split("mean batch ")[1].split(")")[0]) > 1.0, line  # concurrent episodes, one engine call


def test_function_harness_outcomes():
    """--harness-fn: a raising coroutine is a crash (its own TimeoutError too), one past the timeout is cancelled and
    a timeout, a returning one is fine; the coroutine gets the documented keyword arguments."""
    import asyncio
    import types

    from megatron_tsync.runtime.harness import HarnessRunner

    got = {}

    async def ok(**kw):
        got.update(kw)

    async def boom(**kw):
        raise ValueError("bad tool")

    async def own_timeout(**kw):
        raise TimeoutError("the harness' own HTTP timeout")

    async def hang(**kw):
        await asyncio.sleep(3600)

    runner = HarnessRunner.__new__(HarnessRunner)  # only the harness-calling part: no worker, no endpoint
    runner.timeout_s, runner.server = 0.3, types.SimpleNamespace(url="http://127.0.0.1:1/v1", model_name="m")
    outcomes = {}
    for fn in (ok, boom, own_timeout, hang):
        runner.fn = fn
        outcomes[fn.__name__] = asyncio.run(runner._run_fn("s0g0t0", {"prompt": "Q: 1+1 "}))
    assert outcomes["ok"] == (None, "")
    assert got == {"base_url": "http://127.0.0.1:1/v1", "episode_id": "s0g0t0", "task": {"prompt": "Q: 1+1 "},
                   "model": "m"}
    assert outcomes["boom"] == ("harness_crash", "ValueError: bad tool")
    assert outcomes["own_timeout"][0] == "harness_crash"
    assert outcomes["hang"][0] == "harness_timeout"


def test_a_harness_reward_is_checked_against_the_runs_reward_spec():
    """``--reward-kind bounded --reward-range 0 1`` over a binary verifier: a harness's own reward 0.1 is the
    trajectory's (it was refused as "binary reward must be 0.0 or 1.0"); 1.5 is still off the run's spec."""
    import asyncio
    import types

    from megatron_tsync.algorithms.streamability import RewardSpec
    from megatron_tsync.runtime.harness import HarnessRunner
    from megatron_tsync.runtime.worker import WorkerSpec

    runner = HarnessRunner.__new__(HarnessRunner)  # only the scoring part: no worker, no endpoint
    runner.score_trajectory = None  # the verifier: not used when the harness gives its reward
    spec = types.SimpleNamespace(reward_spec={"kind": "bounded", "lo": 0.0, "hi": 1.0})
    spec.run_reward_spec = types.MethodType(WorkerSpec.run_reward_spec, spec)
    runner.w = types.SimpleNamespace(task=types.SimpleNamespace(reward_spec=RewardSpec.binary()), spec=spec)
    traj = types.SimpleNamespace(metadata={"reward": 0.1})
    assert asyncio.run(runner._score(traj, None, None, None, "")) == (0.1, "ok", "")
    traj.metadata["reward"] = 1.5
    reward, status, err = asyncio.run(runner._score(traj, None, None, None, ""))
    assert (reward, status) == (0.0, "error") and err.startswith("harness_bad_reward: ") and "1.5" in err


def test_example_config_is_the_quickstart_driven_by_the_harness():
    """examples/openai_harness/config.yaml = the quickstart's (same model, warm start, task, RL and evaluation) but
    for the harness keys, its folders, its step count and the native tools' latency profile (no native tools)."""
    from megatron_tsync.arguments import parse_args

    ours = parse_args(["--config", os.path.join(ROOT, "examples", "openai_harness", "config.yaml")], world_size=1)
    base = parse_args(["--config", os.path.join(ROOT, "examples", "tiny_agent", "config.yaml")], world_size=1)
    a, b = ours.to_dict(), base.to_dict()
    diff = sorted(f"{s}.{k}" for s in a for k in a[s] if a[s][k] != b[s][k])
    assert diff == ["checkpoint.save", "model.path", "rl.train_iters", "rollout.harness_chat_format",
                    "rollout.harness_fn", "rollout.harness_timeout_s", "rollout.latency_profile",
                    "rollout.latency_scale"], diff
    assert ours.rollout.harness_fn == "examples.openai_harness.agent:run_episode"


def _marked(marks: set[str]) -> list[int]:
    """Pids of live processes whose argv is ``sleep MARK`` for a mark of `marks` (from /proc)."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if len(argv) >= 2 and argv[0].endswith(b"sleep") and argv[1].decode(errors="replace") in marks \
                and state not in "ZX":
            out.append(int(pid))
    return out


_MARK = 900_000 + os.getpid() % 90_000 * 10  # unique `sleep` durations: what the test looks for in /proc
LEFTOVER_CASES = {  # name -> (harness command, outcome, processes left when the episode ended)
    "clean exit, background children": (f"sleep {_MARK} & sleep {_MARK + 1} >/dev/null 2>&1 & exit 0", (None, ""), 2),
    "setsid child, hang past the timeout": (f"setsid sleep {_MARK + 2} & sleep 3600", ("harness_timeout",), 3),
    "double fork": (f"( setsid sleep {_MARK + 3} >/dev/null 2>&1 & ) ; exit 0", (None, ""), 1)}


@pytest.mark.parametrize("case", list(LEFTOVER_CASES))
def test_no_process_a_command_harness_started_outlives_its_episode(case):
    """--harness-cmd: a background child after a clean exit (stderr kept, or redirected), a `setsid` child of a
    command hanging past the timeout, and a double-forked `setsid` orphan are killed and reaped when the episode ends
    (checked by their argv in /proc); a clean episode stays clean (a child holding stderr made it wait for the
    timeout) and the processes left are counted."""
    import asyncio
    import signal
    import types

    from megatron_tsync.runtime.harness import HarnessRunner

    cmd, want, left = LEFTOVER_CASES[case]
    marks = {str(_MARK + i) for i in range(4)}
    runner = HarnessRunner.__new__(HarnessRunner)  # only the harness-calling part: no worker, no endpoint
    # 4 s where the command hangs (its children must have started before the kill, to be counted); a generous limit
    # where it exits by itself, so that a loaded machine's slow shell start-up is not taken for a hang (a 1.5 s limit
    # for every case failed at load 6: 'still running after 1.5s')
    hang = want[0] == "harness_timeout"
    runner.timeout_s = 4.0 if hang else 30.0
    runner.server = types.SimpleNamespace(url="http://127.0.0.1:1/v1", model_name="m")
    runner.w = types.SimpleNamespace(spec=types.SimpleNamespace(rollout=types.SimpleNamespace(harness_cmd=cmd)))
    runner.reaped, runner._warned_subreaper = {"episodes": 0, "left": 0, "killed": 0}, False
    try:
        try:
            got = asyncio.run(asyncio.wait_for(runner._run_cmd("s0g0t0", {"prompt": "p"}), 15 if hang else 45))
        except asyncio.TimeoutError:
            got = ("the episode did not end",)  # a child holding the stderr pipe kept it waiting
        assert got[:len(want)] == want, got
        assert _marked(marks) == [], "a process of the episode is still running"
        assert runner.reaped == {"episodes": 1, "left": left, "killed": left}
    finally:
        for pid in _marked(marks):  # the old code's survivors
            os.kill(pid, signal.SIGKILL)


def test_the_example_agent_runs_on_the_harness_extras_openai(tmp_path, monkeypatch):
    """examples/openai_harness/agent.py with only what the ``harness`` extra pins (setup.py: openai, which since 3.x
    sits on httpx2, not httpx), against a stub endpoint: one completion, then the finish request. The example imported
    ``httpx`` (absent from a fresh venv: rc 1 after the warm start, a 130-line traceback); ``httpx`` is hidden here."""
    import asyncio
    import http.server
    import importlib.metadata
    import re
    import threading

    setup = open(os.path.join(ROOT, "setup.py")).read()
    (pin,) = re.findall(r'"harness": \["openai==([0-9.]+)"\]', setup)
    assert importlib.metadata.version("openai") == pin, "the test venv must hold the harness extra's openai"
    seen = []

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            seen.append((self.path, self.headers.get("X-Episode-Id"), body))
            reply = ({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "<answer>2</answer>"}}]}
                if self.path.endswith("/chat/completions") else {"episode_id": "e", "finished": True})
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setitem(sys.modules, "httpx", None)  # a fresh venv with the extra alone has no httpx
    monkeypatch.delitem(sys.modules, "examples.openai_harness.agent", raising=False)
    try:
        sys.path.insert(0, ROOT)
        from examples.openai_harness.agent import run_episode

        asyncio.run(run_episode(f"http://127.0.0.1:{srv.server_address[1]}/v1", "e", {"prompt": "Q: 1+1 "}, "m"))
    finally:
        sys.path.remove(ROOT)
        srv.shutdown()
    assert [(p, e) for p, e, _ in seen] == [("/v1/chat/completions", "e"), ("/v1/episodes/e/finish", "e")]
    assert seen[0][2]["messages"] == [{"role": "user", "content": "Q: 1+1 "}] and seen[1][2] == {}
