"""log-search (``rollout/envs/log_search.py``): worlds are deterministic and hold the fact exactly once, the tools run
in the real sandbox and return what the demonstration expects, bad calls come back as one-line errors (the model's
text is only data), the tool latency is a wait, and the verdict is the exact answer."""

import asyncio
import time

import pytest

from megatron_tsync.rollout.envs import available_environments, get_environment
from megatron_tsync.rollout.envs.base import run_scripted
from megatron_tsync.rollout.envs.log_search import LETTERS, LEVELS, LogSearchEnv, LogSpec, generate_world
from megatron_tsync.runtime.env_tasks import LogSearchTask


def test_world_is_deterministic_and_holds_the_fact_once():
    spec = LogSpec(files=3, min_pages=2, max_pages=5, page_lines=6)
    w = generate_world(11, spec)
    assert w == generate_world(11, spec) and w != generate_world(12, spec)
    lines = [(path, n, line) for path, pages in w.files for n, page in enumerate(pages, 1) for line in page.split("\n")]
    assert all(2 <= len(pages) <= 5 and all(len(p.split("\n")) == 6 for p in pages) for _, pages in w.files)
    hits = [(path, n) for path, n, line in lines if line.endswith(f" {w.key}={w.code:02d}")]
    assert hits == [(w.path, w.page)]
    assert w.pages == sum(len(pages) for _, pages in w.files)
    # the asked id's first letter starts no other id, and no level word holds it: one place to look
    ids = [line.rsplit(" ", 1)[1].split("=")[0] for _, _, line in lines]
    assert [i for i in ids if i[0] == w.key[0]] == [w.key]
    assert w.key[0] in LETTERS and not any(w.key[0] in lv for lv in LEVELS)
    assert 10 <= w.code <= 99


@pytest.mark.parametrize("kw,match", [(dict(files=0), "files"), (dict(min_pages=3, max_pages=2), "min_pages"),
                                      (dict(page_lines=0), "page_lines"), (dict(code_digits=7), "code_digits")])
def test_spec_refuses_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        LogSpec(**kw)


@pytest.fixture(scope="module")
def task():
    return LogSearchTask(files=3, min_pages=2, max_pages=4, page_lines=5)


def test_demonstration_is_what_the_sandboxed_tools_return(env_sandbox, task):
    inst = task.sample_prompts(0, 1, 7)[0]
    world = inst.meta["world"]
    segs = task.demonstration_segments(inst)
    env = task.make_environment(env_sandbox)
    assert "log-search" in available_environments() and isinstance(get_environment("log-search", sandbox=env_sandbox),
                                                                    LogSearchEnv)
    actions = [s for s, act in segs if act]
    assert len(actions) == world.pages + 3 == inst.meta["turns"]  # next through every page, the end, grep, answer
    verdict, obs = asyncio.run(run_scripted(env, inst, actions[:-1]))
    assert [o.text for o in obs] == [s for s, act in segs[1:] if not act]
    assert all(o.ok for o in obs) and obs[0].text.startswith(f"<result>== {world.files[0][0]} page 1/")
    assert obs[-2].text == f"<result>== end of logs; Q: code of {world.key}? ==</result>"  # the id, restated
    assert actions[-2] == f"<tool>grep: {world.key}</tool>"
    assert obs[-1].text.startswith(f"<result>{world.path} page {world.page}: ")
    assert obs[-1].text.endswith(f" {world.key}={world.code}</result>")
    transcript = "".join(s for s, _ in segs[1:])
    assert verdict.reward == 0.0  # no answer yet

    async def finish(text):
        ep = await env.start(inst)
        return await ep.finish(text)

    assert asyncio.run(finish(transcript)).reward == 1.0
    assert asyncio.run(finish(transcript.replace(f"<answer>{world.code}<", f"<answer>{world.code + 1}<"))).reward == 0


def test_bad_calls_are_one_line_errors(env_sandbox, task):
    inst = task.sample_prompts(1, 1, 7)[0]
    world = inst.meta["world"]
    last = len(dict(world.files)[world.path])
    calls = ["<tool>cat: $(reboot)</tool>", f"<tool>cat: {world.path} 0</tool>",
             "<tool>grep: </tool>", "<tool>rm: -rf logs</tool>", "no call at all", "<tool>ls: </tool>",
             f"<tool>cat: {world.path} {last}</tool>", "<tool>next: </tool>", "<tool>grep: ZZZZ</tool>",
             f"<tool>cat: {world.path} {world.page}</tool>", f"<tool>grep: {world.key}</tool>"]
    _, obs = asyncio.run(run_scripted(LogSearchEnv(env_sandbox), inst, calls))
    texts = [o.text.removeprefix("<result>").removesuffix("</result>") for o in obs]
    assert texts[0] == "error: cat: no such file: $(reboot)"  # the path is data, never run
    assert texts[1] == f"error: cat: {world.path} has pages 1..{last}"
    assert texts[2] == "error: grep: give the text to search for"
    assert texts[3] == "error: unknown tool rm; tools: ls, grep, cat, next"
    assert texts[4].startswith("error: no complete &lt;tool&gt;")  # tags in tool output are escaped
    assert texts[5].split("\n") == [f"{p}  {len(pages)} pages" for p, pages in world.files]
    assert texts[6].startswith(f"== {world.path} page {last}/{last} ==")
    paths = [p for p, _ in world.files]  # next after a file's last page: the next file, or the end
    i = paths.index(world.path)
    end = f"== end of logs; Q: code of {world.key}? =="
    assert texts[7] == (end if i + 1 == len(paths) else texts[7].startswith(f"== {paths[i + 1]} page 1/")
                        and texts[7])
    assert texts[8] == "grep: no page read so far contains ZZZZ"
    assert texts[10] == f"{world.path} page {world.page}: " + next(  # grep searches the pages read: now it finds it
        line for line in texts[9].split("\n") if world.key in line)
    assert [o.ok for o in obs] == [False] * 5 + [True] * 6


def test_tool_latency_is_a_wait(env_sandbox, task):
    inst = task.sample_prompts(2, 1, 7)[0]
    env = LogSearchEnv(env_sandbox, delay_s=0.3)
    t0, c0 = time.perf_counter(), time.process_time()
    _, (obs,) = asyncio.run(run_scripted(env, inst, ["<tool>ls: </tool>"]))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert obs.ok and obs.wall_s >= 0.3 and wall >= 0.3
    assert cpu < 0.25  # the sleep is in the sandboxed child; this process only waits
    with pytest.raises(ValueError, match="delay_s"):
        LogSearchEnv(env_sandbox, delay_s=-1)
