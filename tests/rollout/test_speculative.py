"""Speculative rollouts (rollout/speculative.py): drafts made under θ_k, verified under θ_{k+1}, follow π_{k+1}.

Statistical exactness on a real (tiny, 8-token vocabulary) Megatron model and two weight versions: the exact
probability of every possible completion (≤ 3 tokens, token 0 stops) under θ_{k+1}'s sampling distribution is
enumerated with the engine's scoring pass; 20,000 verified samples must pass a chi-square goodness-of-fit test
(p > 1e-3) while the unverified drafts — the control, distributed as π_k — fail the same test (p < 1e-9). Power: at
TV(π_k, π_{k+1}) ≈ 0.2 a statistic of this size rejects a distribution 0.05 away in TV with near certainty (the
printed statistics show the margin).
"""

import dataclasses
import random

import pytest
import torch

from megatron_tsync.rollout.engine import SamplingConfig, derive_seed
from megatron_tsync.rollout.speculative import (SpeculativeEngine, accepted_prefix, draft_turns,
                                                residual_logprobs)

torch.set_num_threads(1)

V, STOP, PROMPT, N = 8, 0, [1, 2, 3], 20000
SHARP, NOISE = 8.0, 0.25  # output scale, θ_{k+1} − θ_k relative size: TV(π_k, π_{k+1}) ≈ 0.3


def _chi2_p(counts: dict, probs: dict, n: int) -> tuple[float, float, int]:
    """(statistic, p-value, df) of Pearson's chi-square; cells with expected < 5 pooled into one. A sampled
    completion of probability 0 (outside the top-k support) makes the p-value 0."""
    stat, rest_o, rest_e, cells = 0.0, 0.0, 0.0, 0
    for k, p in probs.items():
        e, o = n * p, counts.get(k, 0)
        if e < 5:
            rest_o, rest_e = rest_o + o, rest_e + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    impossible = sum(c for k, c in counts.items() if k not in probs)
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    df = cells - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2,
                                                                                              dtype=torch.float64)))
    return stat, (0.0 if impossible else p), df


# ------------------------------------------------------------------------------------------------ the pure rule
def test_accept_or_residual_gives_p_on_one_position() -> None:
    """One drafted token x ~ q, kept with min(1, p/q), else redrawn from max(0, p − q): the result is ~ p (exact
    rule, no model); control: q itself fails."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(6, generator=g) * 1.5, -1).double()
    res = residual_logprobs(p.log(), q.log()).exp()
    rng = random.Random(1)
    draws = torch.multinomial(q, 40000, replacement=True, generator=g).tolist()
    out = {}
    for x in draws:
        kept = accepted_prefix(p.log()[x : x + 1], q.log()[x : x + 1], [rng.random()])
        y = x if kept else int(torch.multinomial(res, 1, generator=g))
        out[y] = out.get(y, 0) + 1
    _, p_ok, _ = _chi2_p(out, dict(enumerate(p.tolist())), len(draws))
    _, p_ctl, _ = _chi2_p({i: draws.count(i) for i in range(6)}, dict(enumerate(p.tolist())), len(draws))
    assert p_ok > 1e-3 and p_ctl < 1e-9, (p_ok, p_ctl)


def test_residual_is_p_where_p_equals_q() -> None:
    lp = torch.log_softmax(torch.randn(5), -1)
    assert torch.allclose(residual_logprobs(lp, lp).exp(), lp.double().exp(), atol=1e-12)


# ------------------------------------------------------------------------------------------------ on a model
@pytest.fixture(scope="module")
def engines(megatron_single, tiny_dir):
    """(draft engine at θ_k, target engine at θ_{k+1}): a tiny Llama with an 8-token vocabulary, sharp outputs."""
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    arch, _ = load_hf_dir(tiny_dir)
    arch = dataclasses.replace(arch, vocab_size=V)
    old, new = build_model(arch, seed=3), build_model(arch, seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for (name, a), b in zip(old.named_parameters(), new.parameters()):
            if "output_layer" in name or "word_embeddings" in name:
                a.mul_(SHARP)  # peaked next-token distributions (random init is near uniform)
            b.copy_(a + NOISE * a.std() * torch.randn(a.shape, generator=g))  # θ_{k+1}: a different policy
    return (EmbeddedEngine(old, max_batch_rows=4096, version=0), EmbeddedEngine(new, max_batch_rows=4096, version=1))


def _exact(engine, sampling) -> dict:
    """P(completion) under the engine's sampling distribution, every completion of ≤ max_new tokens (STOP ends)."""
    from megatron_tsync.rollout.speculative import sampling_logprobs

    probs, frontier = {}, [((), 1.0)]
    while frontier:
        lg = engine.score([PROMPT + list(t) for t, _ in frontier], [len(PROMPT) + len(t) for t, _ in frontier])
        nxt = []
        for (t, pt), l in zip(frontier, lg):
            _, samp = sampling_logprobs(l[-1], sampling)
            for y, py in enumerate(samp.exp().tolist()):
                if py == 0.0:
                    continue
                s = t + (y,)
                (probs.__setitem__(s, pt * py) if y == STOP or len(s) == sampling.max_new_tokens
                 else nxt.append((s, pt * py)))
        frontier = nxt
    return probs


@pytest.mark.slow  # 20,000 completions per case: the full suite (the rule itself, on one position, is in the fast
#                    tier: test_accept_or_residual_gives_p_on_one_position)
@pytest.mark.parametrize("top_k,draft_cap,interrupt_after", [(0, 3, None), (4, 3, None), (0, 1, None), (0, 3, 1)],
                         ids=["full", "top4", "draft1", "interrupted"])
def test_verified_samples_follow_the_new_policy(engines, top_k, draft_cap, interrupt_after) -> None:
    """20,000 completions drafted under θ_k and verified under θ_{k+1} fit π_{k+1}; the unverified drafts do not.
    draft1: drafts of one token (a draft budget below the turn cap), the rest generated under θ_{k+1}; interrupted:
    the deadline stops the drafting engine after its first decode step (drafts of ≤ 2 tokens, all open)."""
    old, new = engines
    sampling = SamplingConfig(temperature=1.0, top_k=top_k, max_new_tokens=3, stop_token_ids=(STOP,))
    seeds = [derive_seed(11, i) for i in range(N)]
    checks = iter(range(10**9))
    interrupt = None if interrupt_after is None else (lambda: next(checks) >= interrupt_after)
    drafts = draft_turns(old, [PROMPT] * N, seeds, [draft_cap] * N, sampling, interrupt=interrupt)
    if interrupt_after is not None:
        assert max(len(d.tokens) for d in drafts.values()) == interrupt_after + 1
        assert all(d.closed == (d.tokens[-1] == STOP) for d in drafts.values())
    spec = SpeculativeEngine(new, old, drafts)
    out = spec.generate([PROMPT] * N, sampling, 1, seeds=seeds)
    exact, exact_old = _exact(new, sampling), _exact(old, sampling)
    tv = 0.5 * sum(abs(exact.get(k, 0) - exact_old.get(k, 0)) for k in set(exact) | set(exact_old))
    count = lambda seqs: {s: seqs.count(s) for s in set(seqs)}  # noqa: E731
    verified = [tuple(c[0].token_ids) for c in out]
    stat, p_ok, df = _chi2_p(count(verified), exact, N)
    if draft_cap >= 3 and interrupt_after is None:
        stat_c, p_ctl, _ = _chi2_p(count([tuple(d.tokens) for d in drafts.values()]), exact, N)
        assert p_ctl < 1e-9, (stat_c, p_ctl)
    st = spec.stats
    print(f"TV(old,new)={tv:.3f} chi2={stat:.1f} df={df} p={p_ok:.3g} kept {st.kept_tokens}/{st.drafted_tokens} "
          f"rejections {st.rejections}/{st.drafts}")
    assert tv > 0.1 and p_ok > 1e-3, (stat, df, p_ok)
    assert 0 < st.rejections < st.drafts and not spec.drafts  # both branches ran; every draft was used once
    assert all(c[0].policy_version == 1 for c in out)


def test_kept_tokens_carry_the_new_policys_logprobs(engines, megatron_single) -> None:
    """Every token of a verified completion (kept, redrawn or continued) has θ_{k+1}'s log-prob as the trainer's
    ``token_logprobs`` recomputes it (fp32: ≤ 1e-5), not the draft's."""
    from megatron_tsync.model.logprobs import token_logprobs

    old, new = engines
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=6, stop_token_ids=(STOP,))
    seeds = [derive_seed(5, i) for i in range(64)]
    prompts = [PROMPT + [i % V] for i in range(64)]
    drafts = draft_turns(old, prompts, seeds, [4] * 64, sampling)
    out = SpeculativeEngine(new, old, drafts).generate(prompts, sampling, 1, seeds=seeds)
    worst = worst_draft = 0.0
    for p, (c,), d in zip(prompts, out, drafts.values()):
        with torch.no_grad():
            ref = token_logprobs(new.model, torch.tensor([p + c.token_ids]), temperature=0.8)[0, len(p) - 1 :]
        worst = max(worst, float((ref - torch.tensor(c.logprobs)).abs().max()))
        n = min(len(d.tokens), len(c.token_ids))
        if d.tokens[:n] == c.token_ids[:n] and n:
            worst_draft = max(worst_draft, float((ref[:n] - torch.tensor(d.q_logprobs[:n])).abs().max()))
    assert worst < 1e-5 and worst_draft > 1e-2, (worst, worst_draft)


def test_requests_without_a_draft_are_plain_generation(engines) -> None:
    """A seed with no draft (or a draft for another prompt) gets exactly the target's own sample."""
    old, new = engines
    sampling = SamplingConfig(max_new_tokens=4, stop_token_ids=(STOP,))
    seeds = [derive_seed(9, i) for i in range(8)]
    drafts = draft_turns(old, [PROMPT + [5]] * 4, seeds[:4], [4] * 4, sampling)  # other prompt than requested
    got = SpeculativeEngine(new, old, drafts).generate([PROMPT] * 8, sampling, 1, seeds=seeds)
    want = new.generate([PROMPT] * 8, sampling, 1, seeds=seeds)
    assert [c[0].token_ids for c in got] == [c[0].token_ids for c in want]


def test_kv_reuse_sessions_pass_through_to_the_target(engines) -> None:
    """The agent loop's KV-reuse handles (``sessions=``, when the engine ``supports_sessions``): rows without a draft
    go to the target with their session and get the same tokens as without one, and the target keeps their K/V
    (released through the speculative engine); drafted rows are verified as before, their session not cached."""
    old, new = engines
    assert SpeculativeEngine(new, old, {}).supports_sessions == new.supports_sessions
    sampling = SamplingConfig(max_new_tokens=4, stop_token_ids=(STOP,))
    seeds = [derive_seed(11, i) for i in range(8)]
    prompts = [PROMPT + [i % V] for i in range(8)]
    drafts = draft_turns(old, prompts[:4], seeds[:4], [3] * 4, sampling)  # rows 0-3 drafted, 4-7 plain
    sessions = [("s", i) for i in range(8)]
    spec = SpeculativeEngine(new, old, dict(drafts))
    got = spec.generate(prompts, sampling, 1, seeds=seeds, sessions=sessions)
    want = SpeculativeEngine(new, old, dict(drafts)).generate(prompts, sampling, 1, seeds=seeds)
    assert [c[0].token_ids for c in got] == [c[0].token_ids for c in want]
    if new.supports_sessions:
        cached = {s for s in sessions if new.sessions.lookup(s, prompts[s[1]] + [STOP] * 9, 1)[1] is not None}
        assert cached == set(sessions[4:])
        for s in sessions:
            spec.release_session(s)
        assert all(new.sessions.lookup(s, prompts[s[1]] + [STOP] * 9, 1)[1] is None for s in sessions)


def test_stop_strings_are_refused(engines) -> None:
    old, _ = engines
    with pytest.raises(ValueError, match="stop strings"):
        draft_turns(old, [PROMPT], [1], [2], SamplingConfig(max_new_tokens=2, stop_strings=("x",)))


def test_prefill_hook_reads_the_prompt_logits_and_ends_rows(engines) -> None:
    """EmbeddedEngine.generate(prefill_hook=): the hook sees each row's prefill logits (the last position equals
    ``score``'s); a row it ends gets no token, a row it keeps generates exactly what it would have without a hook."""
    _, new = engines
    sampling = SamplingConfig(max_new_tokens=4, stop_token_ids=(STOP,))
    prompts, seeds = [PROMPT, PROMPT + [4, 5], [6]], [derive_seed(3, i) for i in range(3)]
    seen = {}

    def hook(first, logits):
        for j in range(logits.shape[0]):
            seen[first + j] = logits[j, -1].clone()
        return [True, False, True]

    got = new.generate(prompts, sampling, 1, seeds=seeds, prefill_hook=hook)
    want = new.generate(prompts, sampling, 1, seeds=seeds)
    ref = new.score(prompts, [len(p) for p in prompts])
    assert all(torch.allclose(seen[i], ref[i][-1], atol=1e-5) for i in range(3))
    assert got[1][0].token_ids == [] and got[1][0].finish_reason is None
    assert [got[i][0].token_ids for i in (0, 2)] == [want[i][0].token_ids for i in (0, 2)]
