"""reasoning-gym's ``score_answer`` runs behind the sandbox boundary (``rollout/reasoning_gym_scorer.py``):

- code in an answer (countdown hands it to ``sympy.parse_expr``, which ``eval``s it) does not run in this process: a
  marker file it writes is not created, a monkeypatch of the scorer does not reach later answers (the old verifier:
  the marker was written and every later wrong answer scored 1.0);
- ``9**9**9**9`` fails under its reason code at the CPU limit, without growing this process;
- the right answer still scores 1.0, every answer scores what the dataset's own ``score_answer`` gives, answers that
  arrive together share sandbox calls, and a process an answer leaves behind costs only that answer;
- a scorer failure is an "error" trajectory whose error starts with its reason code (``score_trajectory``);
- ``SandboxConfig.preload``: the fork server's modules are warm in a ``run_source`` target.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("reasoning_gym")

pytestmark = pytest.mark.timeout(240)

COUNTDOWN = "reasoning-gym:countdown"


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def countdown():
    from megatron_tsync.runtime.tasks import get_task

    task = get_task(COUNTDOWN, verifier="reasoning_gym")
    return task, task.sample_prompts(0, 4, 0)


@pytest.fixture(scope="module")
def verifier(countdown):
    from megatron_tsync.rollout.verifiers import get_verifier

    task, _ = countdown
    try:
        from megatron_tsync.rollout.reasoning_gym_scorer import ScorerLimits
    except ImportError:  # the in-process verifier before the sandboxed scorer: the control (these tests fail there)
        limits = {}
    else:
        limits = {"limits": ScorerLimits(answer_cpu_s=1, answer_wall_s=60.0)}
    v = get_verifier(task.verifier, **limits, **task.verifier_kwargs)
    yield v
    if hasattr(v, "close"):
        v.close()


def _score(verifier, answer: str, inst):
    return asyncio.run(verifier.evaluate(f"<answer>{answer}</answer>", inst.verifier_task())).reward


def test_code_in_an_answer_does_not_run_in_this_process(verifier, countdown, tmp_path):
    from reasoning_gym.games.countdown import CountdownDataset

    _, insts = countdown
    inst = insts[0]
    code = CountdownDataset.score_answer.__code__
    wrong = "1 + 2"
    assert _score(verifier, inst.answer, inst) == 1.0
    before = _score(verifier, wrong, inst)
    assert before < 1.0
    marker = tmp_path / "pwned"
    _score(verifier, f"__import__('builtins').open('{marker}', 'w').write('x')", inst)
    patch = ("__import__('builtins').exec('import reasoning_gym.games.countdown as m; "
             "m.CountdownDataset.score_answer.__code__ = (lambda self, answer, entry: 1.0).__code__')")
    _score(verifier, patch, inst)
    assert not marker.exists(), "an answer's code wrote a file outside the sandbox"
    assert CountdownDataset.score_answer.__code__ is code, "an answer's code patched the scorer in this process"
    assert _score(verifier, wrong, inst) == before < 1.0  # a later wrong answer is still wrong
    assert _score(verifier, inst.answer, inst) == 1.0


def test_power_tower_fails_under_its_reason_without_growing_this_process(verifier, countdown):
    from megatron_tsync.rollout.reasoning_gym_scorer import ScorerFailed

    _, insts = countdown
    _score(verifier, "1 + 2", insts[0])  # the scorer is warm
    rss0 = _rss_kb()
    with pytest.raises(ScorerFailed) as e:
        _score(verifier, "9**9**9**9", insts[0])
    assert e.value.reason == "scorer_cpu_limit", e.value
    assert _rss_kb() - rss0 < 20_000  # KiB: the computation ran elsewhere
    assert _score(verifier, insts[0].answer, insts[0]) == 1.0  # and the scorer goes on


def test_scores_match_the_datasets_own_and_answers_share_calls(verifier, countdown):
    import reasoning_gym

    task, insts = countdown
    own = reasoning_gym.create_dataset("countdown", seed=0, size=1)
    answers = [(inst, a) for inst in insts for a in (inst.answer, "1 + 2", "", "x*", " ".join(map(
        str, inst.meta["entry"]["metadata"]["numbers"])))]

    async def all_at_once():
        return await asyncio.gather(*(verifier.evaluate(f"<answer>{a}</answer>", i.verifier_task())
                                      for i, a in answers))

    calls = verifier.scorer.calls
    got = [s.reward for s in asyncio.run(all_at_once())]
    assert got == [own.score_answer(a, i.meta["entry"]) for i, a in answers]  # benign answers: same in-process
    assert got.count(1.0) == len(insts)
    assert verifier.scorer.calls - calls < len(answers) // 2  # batched


def test_a_process_left_behind_costs_only_its_own_answer(verifier, countdown):
    """An answer that forks a process into its own session (out of reach of the group kill): the batch stops after
    it and the answers behind it are scored in a fresh call, correctly."""
    _, insts = countdown
    # the child answers only once its child has its own session (else the group kill may come first)
    stray = ("__import__('builtins').exec('import os, time\\np = os.fork()\\nif p == 0:\\n os.setsid()\\n "
             "time.sleep(600)\\nwhile os.getsid(p) != p:\\n time.sleep(0.01)')")
    answers = [(stray, insts[0]), (insts[0].answer, insts[0]), ("1 + 2", insts[0]), (insts[1].answer, insts[1])]
    wrong = _score(verifier, "1 + 2", insts[0])  # also warms the scorer: the four below queue together

    async def together():
        return await asyncio.gather(*(verifier.evaluate(f"<answer>{a}</answer>", i.verifier_task())
                                      for a, i in answers), return_exceptions=True)

    calls = verifier.scorer.calls
    got = asyncio.run(together())
    assert [g.reward for g in got[1:]] == [1.0, wrong, 1.0]
    assert verifier.scorer.calls - calls >= 2  # the stray's batch stopped; the rest went to a new call


def test_a_scorer_failure_is_an_error_trajectory_with_its_reason(verifier, countdown):
    from types import SimpleNamespace

    from megatron_tsync.runtime.worker import score_trajectory

    task, insts = countdown
    codec = SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))

    def traj(answer):
        text = f"<answer>{answer}</answer>"
        ids = [0] + [ord(c) for c in text]
        return SimpleNamespace(error=None, token_ids=ids, loss_mask=[0] + [1] * (len(ids) - 1), prompt_len=1)

    spec = task.reward_spec
    ok = asyncio.run(score_trajectory(traj(insts[0].answer), codec, insts[0], None, verifier, 0.0, spec))
    assert ok == (1.0, "ok", "")
    reward, status, err = asyncio.run(score_trajectory(traj("__import__('sys').exit(5)"), codec, insts[0], None,
                                                       verifier, 0.0, spec))
    assert (reward, status) == (0.0, "error") and err.startswith("verifier failed: scorer_raised: countdown"), err
    reward, status, err = asyncio.run(score_trajectory(traj("9**9**9**9"), codec, insts[0], None, verifier, 0.0, spec))
    assert (reward, status) == (0.0, "error") and err.startswith("verifier failed: scorer_cpu_limit:"), err


def test_out_of_range_or_non_finite_scores_are_refused():
    from megatron_tsync.rollout.reasoning_gym_scorer import ReasoningGymScorer, ScorerFailed

    s = ReasoningGymScorer()
    assert s._check("ok", "0.25", "d") == 0.25
    for verdict, value in (("ok", "1.5"), ("ok", "nan"), ("ok", "inf"), ("ok", "1e400x"), ("weird", "1.0")):
        with pytest.raises(ScorerFailed) as e:
            s._check(verdict, value, "d")
        assert e.value.reason in ("scorer_bad_score", "scorer_failed")


def test_preloaded_modules_are_warm_in_run_source():
    from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig

    with pytest.raises(ValueError, match="preload needs launcher='fork-server'"):
        Sandbox(SandboxConfig(preload=("json",), launcher="exec"))
    probe = "import sys\nprint('colorsys' in sys.modules)"
    for preload, want in (((), "False"), (("colorsys",), "True")):
        sb = Sandbox(SandboxConfig(preload=preload))
        try:
            r = sb.run_source(probe)
            assert r.ok and r.stdout.strip() == want, r
        finally:
            sb.close()
