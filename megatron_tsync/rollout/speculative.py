"""Speculative next-batch rollouts: turns drafted under θ_k, verified exactly under θ_{k+1}.

While the learner finishes step k (its tail, the barrier, the weight hand-off) a rollout worker's engine would idle.
It drafts instead: the first turn of each of its step-(k+1) trajectories (their prompts are known in advance), sampled
under θ_k with the step-(k+1) sampling parameters, recording each drafted token's sampling probability q(x_t).
When θ_{k+1} lands, the step's first ``generate`` call of each trajectory is answered by :class:`SpeculativeEngine`:

1. one ``generate`` under θ_{k+1} whose prompt is prompt + draft: its prefill gives p(·) at each drafted position
   (the engine's ``prefill_hook``), and the rows whose whole draft is kept go on decoding from the cache that prefill
   built, so a kept draft costs its tokens' share of one prefill instead of their decode steps;
2. token t is kept with probability min(1, p(x_t) / q(x_t)) (its own uniform; the first rejection ends the scan);
3. at the first rejected position the token is redrawn from the residual  max(0, p − q) / Σ max(0, p − q);  the full
   q(·) there comes from one scoring pass of prompt + kept prefix under θ_k (the engine that drafted: it still holds
   θ_k) — recomputed, not stored: storing q(·) for every drafted position costs vocab × tokens floats (Qwen3:
   152k × 4 B = 0.6 MB per token);
4. the turn then continues under θ_{k+1} exactly as plain generation would (its own seed): a second ``generate``,
   for the rejected rows only.

Every token of the result is distributed as π_{k+1} (the speculative-sampling theorem, applied position by position:
given the kept prefix, P(token = y) = q(y)·min(1, p(y)/q(y)) + (1 − Σ_z min(p(z), q(z)))·r(y) = p(y)); p and q are the
*sampling* distributions (temperature, top-k / top-p truncation included), so truncated sampling stays exact too. The
returned log-probs are θ_{k+1}'s (the convention of ``rollout/engine.py``), the completion's policy version is k+1:
the learner treats the turn as on-policy, because it is.

What is exact and therefore what is drafted: only a trajectory's first turn. A tool call is never executed for a
draft: the turn's tool call runs after verification, on the verified transcript (the agent loop does that as usual),
so no tool result that the verified transcript would not have produced is ever kept, and stateful workspaces need no
fork. Not supported (refused with a message): stop strings (use stop token ids), router-replay recording (MoE).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Sequence

import torch

from megatron_tsync.rollout.agent_loop import _truncate  # the first N tokens of a completion (finish "length")
from megatron_tsync.rollout.engine import Completion, SamplingConfig, derive_seed

DRAFT_TAG, VERIFY_TAG, CONTINUE_TAG = 0x5D, 0x5E, 0x5F
"""Seed coordinates of a draft's own random streams: drafting, acceptance/residual uniforms, the continuation."""


# ------------------------------------------------------------------------------------------------ the pure rule
def accepted_prefix(p_tok_logp: torch.Tensor, q_tok_logp: torch.Tensor, uniforms: Sequence[float]) -> int:
    """How many drafted tokens are kept: the first t with u_t >= p(x_t) / q(x_t) is rejected (keep prob min(1, p/q)).

    ``p_tok_logp`` / ``q_tok_logp``: (n,) log-probabilities of the drafted tokens under the verifying and the drafting
    sampling distributions; ``uniforms``: n independent U[0, 1) draws."""
    ratio = (p_tok_logp.double() - q_tok_logp.double()).exp()
    u = torch.tensor(list(uniforms)[: len(ratio)], dtype=torch.float64)
    rejected = (u >= ratio).nonzero()
    return int(rejected[0, 0]) if len(rejected) else int(len(ratio))


def residual_logprobs(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """log of max(0, p − q) normalised (V,), in float64: the distribution a rejected position is redrawn from.

    When p ≤ q nowhere leaves mass (p == q up to rounding; then no rejection can occur but by rounding) it is p."""
    r = (p_logp.double().exp() - q_logp.double().exp()).clamp_min(0.0)
    total = r.sum()
    if not bool(total > 0):
        return p_logp.double() - torch.logsumexp(p_logp.double(), dim=-1)
    return (r / total).log()


def sampling_logprobs(logits: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(full temperature log-probs, sampling log-probs after top-k / top-p) of (…, V) logits, as the engines sample."""
    from megatron_tsync.rollout.embedded_engine import temperature_logprobs, truncate_logprobs

    flat = logits.reshape(-1, logits.shape[-1]).float()
    full = temperature_logprobs(flat, sampling.temperature)
    samp = truncate_logprobs(full, sampling.top_k, sampling.top_p) if sampling.truncates else full
    return full.reshape(logits.shape), samp.reshape(logits.shape)


# ------------------------------------------------------------------------------------------------ drafts
@dataclasses.dataclass
class Draft:
    """One drafted turn: ``tokens`` sampled under ``version`` from ``prompt``; ``q_logprobs[t]`` the drafting
    *sampling* log-prob of ``tokens[t]``; ``closed``: it ended in a stop / tool token (else it was cut by its cap or
    the draft budget and verification continues it)."""

    prompt: tuple[int, ...]
    tokens: list[int]
    q_logprobs: list[float]
    closed: bool
    version: int


def draft_turns(engine, prompts: Sequence[Sequence[int]], keys: Sequence[int], caps: Sequence[int],
                sampling: SamplingConfig, interrupt=None) -> dict[int, Draft]:
    """Drafts one turn per prompt with ``engine`` (its current weights): ``keys[i]`` is the seed the agent loop will
    pass for that turn (the draft's randomness is derived from it, independent of the verification's); ``caps[i]``
    its token cap (the turn's cap, or less: a draft budget). ``interrupt``: the deadline — once it returns True the
    engine stops and every draft is what it has so far (empty drafts are dropped). Returns {key: Draft}."""
    drafts: dict[int, Draft] = {}
    extend_drafts(engine, drafts, {int(k): (tuple(int(t) for t in p), int(c)) for k, p, c in zip(keys, prompts, caps)},
                  sampling, interrupt)
    return drafts


def extend_drafts(engine, drafts: dict[int, Draft], todo: dict[int, tuple[tuple[int, ...], int]],
                  sampling: SamplingConfig, interrupt=None) -> int:
    """Drafts every open turn of ``todo`` ({key: (prompt, cap)}) further, in one batched ``generate`` under the
    engine's current weights, into ``drafts`` (a draft of another version starts over); returns the tokens added.

    A draft resumed after an interruption continues from its own tokens with fresh randomness (``derive_seed(key,
    DRAFT_TAG, tokens so far)``): every drafted token is still a draw from q given its prefix, which is all that
    verification needs."""
    _check_supported(sampling, engine)
    version, rows = engine.policy_version, []
    for key, (prompt, cap) in todo.items():
        d = drafts.get(key)
        if d is not None and d.version != version:
            drafts.pop(key)
            d = None
        if d is None or (not d.closed and len(d.tokens) < cap):
            rows.append((key, prompt, cap, [] if d is None else d.tokens))
    if not rows:
        return 0
    cfg = dataclasses.replace(sampling, max_new_tokens=max(c - len(t) for _, _, c, t in rows), seed=None)
    kw = {} if interrupt is None else {"interrupt": interrupt}
    outs = engine.generate([list(p) + t for _, p, _, t in rows], cfg, n=1,
                           seeds=[derive_seed(k, DRAFT_TAG, len(t)) for k, _, _, t in rows], **kw)
    added = 0
    for (key, prompt, cap, have), (comp,) in zip(rows, outs):
        room = cap - len(have)
        toks = list(comp.token_ids[:room])
        q = list((comp.sampling_logprobs if sampling.truncates else comp.logprobs)[:room])
        if not toks:
            continue
        closed = comp.finish_reason in ("stop", "tool") and len(comp.token_ids) <= room
        old = drafts.get(key)
        drafts[key] = Draft(prompt, have + toks, (old.q_logprobs if old else []) + q, closed, comp.policy_version)
        added += len(toks)
    return added


def _check_supported(sampling: SamplingConfig, engine) -> None:
    if sampling.stop_strings:
        raise ValueError("speculative rollouts need stop token ids, not stop strings (a kept prefix would have to be "
                         "re-checked against the strings)")
    if getattr(engine, "record_routing", False):
        raise ValueError("speculative rollouts do not record MoE routing for router replay yet")


@dataclasses.dataclass
class SpecStats:
    """What verification did, per engine (cumulative): drafts used, tokens drafted / kept, rejections."""

    drafts: int = 0
    drafted_tokens: int = 0
    kept_tokens: int = 0
    rejections: int = 0
    verify_s: float = 0.0
    """Seconds spent verifying (scoring passes, residual draws, the continuations' generate)."""


class SpeculativeEngine:
    """A ``RolloutEngine`` over ``target`` (θ_{k+1}) that answers a request whose per-row seed has a draft by verifying
    it (module docstring) and every other request by ``target.generate``. ``draft_engine`` holds the drafting weights
    (θ_k). Each draft is used once. What the engines need beyond the protocol: ``generate(..., prefill_hook=)`` of the
    target and ``score(seqs, first)`` of the draft engine (``rollout/embedded_engine.py``)."""

    def __init__(self, target, draft_engine, drafts: dict[int, Draft]):
        self.target, self.draft_engine, self.drafts = target, draft_engine, dict(drafts)
        self.stats = SpecStats()
        self.outcome: dict[int, tuple[int, int]] = {}  # seed -> (tokens drafted, tokens kept) of each verified draft

    @property
    def policy_version(self) -> int:
        return self.target.policy_version

    @property
    def supports_sessions(self) -> bool:
        """KV reuse across turns (the agent loop's session handles): the target's. Rows without a draft pass their
        session to ``target.generate``; a verified row's turn is not cached (its prefill is the verification's), so
        its trajectory's next turn prefills in full once and is cached from then on."""
        return bool(getattr(self.target, "supports_sessions", False))

    def release_session(self, session) -> None:
        self.target.release_session(session)

    def update_weights(self, state_dict, version: int) -> None:
        self.drafts.clear()  # drafts are verified against the weights they were made for: new weights void them
        self.target.update_weights(state_dict, version)

    def generate(self, prompts, sampling: SamplingConfig, n: int = 1, *, seeds=None,
                 sessions=None) -> list[list[Completion]]:
        hit = [] if n != 1 or seeds is None else [
            i for i, (p, s) in enumerate(zip(prompts, seeds))
            if (d := self.drafts.get(int(s))) is not None and d.prompt == tuple(int(t) for t in p)]
        extra = {} if sessions is None else {"sessions": sessions}
        if not hit:
            return self.target.generate(prompts, sampling, n, seeds=seeds, **extra)
        _check_supported(sampling, self.target)
        out: list[list[Completion] | None] = [None] * len(prompts)
        hit_set = set(hit)  # once: a set per index made this quadratic (20,000 prompts: ~10 s)
        rest = [i for i in range(len(prompts)) if i not in hit_set]
        if rest:
            if sessions is not None:
                extra = {"sessions": [sessions[i] for i in rest]}
            for i, comps in zip(rest, self.target.generate([prompts[i] for i in rest], sampling, 1,
                                                           seeds=[seeds[i] for i in rest], **extra)):
                out[i] = comps
        drafts = [self.drafts.pop(int(seeds[i])) for i in hit]
        t0 = time.perf_counter()
        for i, comp in zip(hit, self._verify(drafts, [int(seeds[i]) for i in hit], sampling)):
            out[i] = [comp]
        self.stats.verify_s += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ verification
    def _verify(self, drafts: list[Draft], seeds: list[int], sampling: SamplingConfig) -> list[Completion]:
        """One ``generate`` under θ_{k+1} whose prefill is prompt + draft: the prefill hook scores every draft (its
        logits at the draft's positions) and lets a row go on decoding, with the cache it just built, only where the
        whole draft was kept and is open; rejected rows are redrawn and continued by a second ``generate``."""
        n = len(drafts)
        kept, new, lps, slps = [0] * n, [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        at_reject: dict[int, torch.Tensor] = {}  # row -> raw θ_{k+1} logits at its first rejected position

        def hook(first: int, logits: torch.Tensor) -> list[bool]:
            go = []
            for j in range(logits.shape[0]):
                r, d = first + j, drafts[first + j]
                m = len(d.tokens)
                lg = logits[j, logits.shape[1] - m - 1 : -1]  # (m, V): the distributions of the draft's tokens
                full, samp = sampling_logprobs(lg, sampling)
                idx = torch.tensor(d.tokens, dtype=torch.long)[:, None]
                rng = random.Random(derive_seed(seeds[r], VERIFY_TAG))
                a = accepted_prefix(samp.gather(-1, idx)[:, 0], torch.tensor(d.q_logprobs), [rng.random() for _ in d.tokens])
                kept[r], new[r] = a, d.tokens[:a]
                lps[r], slps[r] = full[:a].gather(-1, idx[:a])[:, 0].tolist(), samp[:a].gather(-1, idx[:a])[:, 0].tolist()
                if a < m:
                    at_reject[r] = lg[a].clone()
                go.append(a == m and not d.closed and m < sampling.max_new_tokens)
            return go

        cfg = dataclasses.replace(sampling, max_new_tokens=max(1, max(sampling.max_new_tokens - len(d.tokens)
                                                                         for d in drafts)), seed=None)
        outs = self.target.generate([list(d.prompt) + d.tokens for d in drafts], cfg, 1,
                                    seeds=[derive_seed(s, CONTINUE_TAG) for s in seeds], prefill_hook=hook)
        tails = {r: _truncate(o[0], sampling.max_new_tokens - len(drafts[r].tokens))
                 for r, o in enumerate(outs) if o[0].token_ids}
        closed = [r not in at_reject for r in range(n)]  # kept whole: finished by its draft or continued above
        rejected = sorted(at_reject)
        self._redraw(drafts, seeds, at_reject, rejected, kept, new, lps, slps, closed, sampling)
        self._count(drafts, kept, rejected)
        self.outcome.update({s: (len(d.tokens), a) for s, d, a in zip(seeds, drafts, kept)})
        tails.update(self._continue(drafts, seeds, [r for r in rejected if not closed[r]], new, sampling))
        return [self._compose(r, new[r], lps[r], slps[r], tails.get(r), sampling) for r in range(n)]

    def _redraw(self, drafts, seeds, at_reject, rejected, kept, new, lps, slps, closed, sampling) -> None:
        """At each row's first rejected position: q(·) from the drafting engine, one draw from max(0, p − q)."""
        if not rejected:
            return
        from megatron_tsync.rollout.embedded_engine import sample_inverse_cdf

        prefixes = [list(drafts[r].prompt) + drafts[r].tokens[: kept[r]] for r in rejected]
        q_logits = self.draft_engine.score(prefixes, [len(p) for p in prefixes])  # (1, V) each: the next token
        for r, ql in zip(rejected, q_logits):
            a = kept[r]
            full, samp = sampling_logprobs(at_reject[r], sampling)
            _, q_samp = sampling_logprobs(ql[-1], sampling)
            rng = random.Random(derive_seed(seeds[r], VERIFY_TAG, 1))
            y = int(sample_inverse_cdf(residual_logprobs(samp, q_samp)[None], [rng.random()])[0])
            new[r] = new[r] + [y]
            lps[r] = lps[r] + [float(full[y])]
            slps[r] = slps[r] + [float(samp[y])]
            closed[r] = (y in sampling.stop_token_ids or y in sampling.tool_token_ids
                         or len(new[r]) >= sampling.max_new_tokens)

    def _count(self, drafts, kept, rejected) -> None:
        st = self.stats
        st.drafts += len(drafts)
        st.drafted_tokens += sum(len(d.tokens) for d in drafts)
        st.kept_tokens += sum(kept)
        st.rejections += len(rejected)

    def _continue(self, drafts, seeds, rows: list[int], new, sampling) -> dict[int, Completion]:
        """Rejected rows not finished by their redrawn token go on under θ_{k+1} (one batched ``generate``)."""
        if not rows:
            return {}
        caps = [sampling.max_new_tokens - len(new[r]) for r in rows]
        cfg = dataclasses.replace(sampling, max_new_tokens=max(caps), seed=None)
        outs = self.target.generate([list(drafts[r].prompt) + new[r] for r in rows], cfg, 1,
                                    seeds=[derive_seed(seeds[r], CONTINUE_TAG, 1) for r in rows])
        return {r: _truncate(o[0], c) for r, c, o in zip(rows, caps, outs)}

    def _compose(self, r, toks, lps, slps, tail: Completion | None, sampling) -> Completion:
        finish = tail.finish_reason if tail is not None else _finish(toks, sampling)
        if tail is not None:
            toks, lps = toks + list(tail.token_ids), lps + list(tail.logprobs)
            slps = slps + list(tail.sampling_logprobs or [])
        return Completion(token_ids=toks, logprobs=lps, finish_reason=finish,
                          sampling_logprobs=slps if sampling.truncates else None,
                          policy_version=self.target.policy_version)

    def __getattr__(self, name):  # the target's other attributes (vocab_size, max_seq_len, ...)
        if name in ("target", "draft_engine", "drafts", "stats"):
            raise AttributeError(name)
        return getattr(self.target, name)


def _finish(tokens: list[int], sampling: SamplingConfig) -> str:
    last = tokens[-1] if tokens else None
    if last in sampling.tool_token_ids:
        return "tool"
    if last in sampling.stop_token_ids:
        return "stop"
    return "length"
