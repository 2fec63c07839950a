"""The log-search task (``runtime/env_tasks.py``): deterministic, disjoint train / held-out worlds, group g of a step
independent of the number of groups, the exact-answer verifier required, and a demonstration that is observation
heavy (the point of the task: the learner processes far more tool output than the agent generates)."""

import pytest

from megatron_tsync.runtime.tasks import get_task

NAME = "megatron_tsync.runtime.env_tasks:log-search"


def test_splits_are_deterministic_and_disjoint():
    t = get_task(NAME)
    a = t.sample_prompts(3, 8, 1234)
    assert [i.meta["world_seed"] for i in a] == [i.meta["world_seed"] for i in t.sample_prompts(3, 8, 1234)]
    assert [i.meta["world_seed"] for i in a[:3]] == [i.meta["world_seed"] for i in t.sample_prompts(3, 3, 1234)]
    ev = {i.meta["world_seed"] for s in range(4) for i in t.sample_prompts(s, 16, 1234, split="eval")}
    tr = {i.meta["world_seed"] for s in range(4) for i in t.sample_prompts(s, 16, 1234)}
    assert len(ev) == len(tr) == 64 and not ev & tr
    inst = a[0]
    assert inst.prompt_text == f"<s>Q: code of {inst.meta['world'].key}? " and inst.answer == inst.meta["world"].code
    assert t.reward_spec.binary
    with pytest.raises(ValueError, match="split"):
        t.sample_prompts(0, 1, 0, split="test")


def test_refuses_another_verifier_and_bad_knobs():
    with pytest.raises(ValueError, match="--verifier must be 'exact_answer'"):
        get_task(NAME, verifier="answer_with_format")
    with pytest.raises(ValueError, match="min_pages"):
        get_task(NAME, min_pages=5, max_pages=4)
    with pytest.raises(ValueError, match="heldout_mod"):
        get_task(NAME, heldout_mod=1)


def test_short_worlds_are_a_share_of_both_splits():
    """``short_frac``: that share of worlds (by world seed, in both splits) is one page of one file; 0 (the default)
    turns it off."""
    t, full = get_task(NAME, short_frac=0.5), get_task(NAME)
    for split in ("train", "eval"):
        insts = [i for s in range(4) for i in t.sample_prompts(s, 32, 9, split=split)]
        short = [i for i in insts if i.meta["world"].pages == 1]
        assert 0.35 < len(short) / len(insts) < 0.65, (split, len(short))
        assert all(len(i.meta["world"].files) == 1 and i.meta["turns"] == 4 for i in short)
    assert all(i.meta["world"].pages >= 2 * full.min_pages for i in full.sample_prompts(0, 32, 9))
    with pytest.raises(ValueError, match="short_frac"):
        get_task(NAME, short_frac=1.5)


def test_warm_start_curriculum_is_easier_worlds_first():
    """``warm_tiny_steps`` / ``warm_short_steps``: the warm start's first batches are one page of 2 lines, then one
    page of 8 lines, later ones (and RL's, and the held-out split) the task's own worlds."""
    t = get_task(NAME, warm_tiny_steps=2, warm_short_steps=2)
    tiny = [i for s in range(2) for i in t.warm_start_prompts(s, 8, 5)]
    assert all(i.meta["world"].pages == 1 and len(i.meta["world"].files[0][1][0].split("\n")) == 2 for i in tiny)
    short = [i for s in (2, 3) for i in t.warm_start_prompts(s, 8, 5)]
    assert all(i.meta["world"].pages == 1 and len(i.meta["world"].files[0][1][0].split("\n")) == 8 for i in short)
    assert all(i.meta["world"].pages >= 4 for s in (4, 5) for i in t.warm_start_prompts(s, 8, 5))
    assert [i.meta["world_seed"] for i in t.warm_start_prompts(4, 8, 5)] == \
        [i.meta["world_seed"] for i in t.sample_prompts(4, 8, 5)]
    assert all(i.meta["world"].pages >= 4 for s in (0, 1) for sp in ("train", "eval")
               for i in t.sample_prompts(s, 8, 5, split=sp))
    with pytest.raises(ValueError, match="warm_tiny_steps"):
        get_task(NAME, warm_short_steps=-1)


def test_demonstration_is_observation_heavy():
    t = get_task(NAME, min_pages=3, max_pages=3)
    acted = observed = 0
    for inst in t.sample_prompts(0, 8, 5):
        segs = t.demonstration_segments(inst)
        acted += sum(len(s) for s, act in segs if act)
        observed += sum(len(s) for s, act in segs[1:] if not act)
        assert sum(act for _, act in segs) == inst.meta["turns"] == inst.meta["world"].pages + 3
        assert t.demonstration(inst).endswith(f"<answer>{inst.answer}</answer>")
    assert observed > 5 * acted, (observed, acted)  # characters; in tokens see docs/benchmarks.md


def test_recipe_fits_the_task():
    """examples/log_search/config.yaml parses, names this task, and leaves room for a correct transcript: every
    demonstration's turns within --max-turns, its characters / 3 (preflight's estimate) within --seq-length."""
    import os

    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.tasks import task_from_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = parse_args(["--config", os.path.join(root, "examples", "log_search", "config.yaml")], world_size=1)
    t = task_from_config(cfg.rollout)
    assert t.name == "log-search" and cfg.learner.mode == "stream-trajectory" and cfg.rollout.latency_profile != "none"
    assert cfg.rl.max_turns >= t.files * t.max_pages + 3 and cfg.learner.max_packed_tokens >= cfg.rl.seq_length
    longest = max(len(t.demonstration(i)) for s in range(2) for i in t.sample_prompts(s, 16, 3))
    assert longest / 3 < cfg.rl.seq_length


def test_pages_fit_one_observation_and_dominate_the_tokens(tiny_dir):
    """With the tiny model's tokenizer: every observation of a correct transcript fits the agent loop's
    ``max_result_tokens`` (a page is never cut), and tool output is most of a trajectory's tokens."""
    from transformers import AutoTokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec, encode_observation
    from megatron_tsync.rollout.agent_loop import AgentConfig
    from megatron_tsync.training.sft import demonstration_tokens

    codec = TokenizerCodec(AutoTokenizer.from_pretrained(tiny_dir))
    cap = AgentConfig.__dataclass_fields__["max_result_tokens"].default
    t = get_task(NAME)
    total = acted = 0
    for inst in t.sample_prompts(0, 8, 11):
        segs = t.demonstration_segments(inst)
        assert max(len(encode_observation(codec, s)) for s, act in segs[1:] if not act) < cap
        ids, mask = demonstration_tokens(codec, segs)
        total, acted = total + len(ids), acted + sum(mask)
    assert acted < 0.15 * total, (acted, total)
