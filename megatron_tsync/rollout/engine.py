"""The rollout-engine protocol: what every inference engine (vLLM on GPU, the embedded Megatron engine on CPU)
offers the agent loop, plus a contract check any implementation can be run against.

Log-prob convention (the one the learner's importance ratios rely on):

- ``Completion.logprobs[t]`` is ``log softmax(logits_t / T)[token_t]``: the temperature-scaled distribution over
  the **whole** vocabulary — exactly what ``model.logprobs.token_logprobs(model, ids, temperature=T)``
  recomputes for the same weights. This is what the learner compares against (behaviour log-probs).
- With top-k / top-p the token is drawn from the truncated, renormalised distribution. Its log-prob under that
  distribution is returned separately in ``Completion.sampling_logprobs`` (``None`` when no truncation was
  applied). Using ``logprobs`` for the ratio treats truncation as part of the environment (the common practice);
  ``sampling_logprobs`` is there for exact off-policy correction. Greedy decoding is ``top_k=1`` (its
  ``sampling_logprobs`` are 0); ``temperature`` must be > 0.
- Stop tokens (EOS, ``</tool>``, ``</answer>`` …) are generated actions: they are kept as the last entry of
  ``token_ids`` with their log-prob.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

FinishReason = Literal["stop", "length", "tool"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample one batch of completions."""

    temperature: float = 1.0
    """Softmax temperature (> 0). Log-probs are of ``softmax(logits / temperature)``."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off; 1 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set with cumulative probability ≥ top_p (1.0 = off)."""
    max_new_tokens: int = 64
    """Hard cap on generated tokens per completion (finish_reason "length" when reached)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion with finish_reason "stop" (EOS, ``</answer>``)."""
    tool_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion with finish_reason "tool" (the id of ``</tool>``)."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a completion ("stop") once the decoded output contains them; needs an engine with a
    detokenizer. Prefer token ids: they are exact and free."""
    seed: int | None = None
    """Base seed. Completion j of prompt i draws from its own generator seeded from (seed, i, j), so outputs do
    not depend on how requests are batched. ``None``: not reproducible."""

    def __post_init__(self):
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "tool_token_ids", tuple(int(t) for t in self.tool_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    @property
    def truncates(self) -> bool:
        """True when top-k/top-p change the sampling distribution."""
        return self.top_k > 0 or self.top_p < 1.0

    @classmethod
    def from_config(cls, *sections: Any, **runtime: Any) -> "SamplingConfig":
        """The one place a run's sampling parameters are derived from its configuration.

        Every field not in ``RUNTIME_FIELDS`` is read from the first of ``sections`` (config dataclasses:
        ``RolloutConfig`` for temperature / top_k / top_p, ``RLConfig`` for max_new_tokens) that has a field of the
        same name; ``runtime`` sets the others (the tokenizer's stop / tool token ids, the seed). A new sampling flag
        is thus a field here (with its check in ``__post_init__``), a field of the same name in ``config/`` (which
        validates it through this class) and its row in ``arguments.py``. A field found in no section is a TypeError.
        """
        unknown = sorted(set(runtime) - set(RUNTIME_FIELDS))
        if unknown:
            raise TypeError(f"SamplingConfig.from_config: {unknown} are not run-time fields {RUNTIME_FIELDS}")
        kw = dict(runtime)
        for f in dataclasses.fields(cls):
            if f.name in RUNTIME_FIELDS:
                continue
            owner = next((sec for sec in sections if f.name in {g.name for g in dataclasses.fields(sec)}), None)
            if owner is None:
                raise TypeError(f"SamplingConfig.{f.name} is a field of none of the config sections given "
                                f"({', '.join(type(sec).__name__ for sec in sections)})")
            kw[f.name] = getattr(owner, f.name)
        return cls(**kw)


RUNTIME_FIELDS = ("stop_token_ids", "tool_token_ids", "stop_strings", "seed")
"""``SamplingConfig`` fields that come from the tokenizer / the step, not from the run's configuration."""


@dataclasses.dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]
    """Per generated token: log softmax(logits / T)[token] (see the module docstring)."""
    finish_reason: FinishReason
    sampling_logprobs: list[float] | None = None
    """Per token log-prob under the truncated (top-k/top-p) distribution; None when nothing was truncated."""
    policy_version: int = -1
    """The weights version that produced every token of this completion."""
    routing: Any = None
    """MoE engines asked to record routing (``record_routing=True``): a (P, L, k) integer array, the experts each
    of the L MoE layers chose for the tokens at positions 0..P-1 of prompt + completion, where P = len(prompt) +
    len(token_ids) - 1 (every position the engine computed; the last sampled token is never fed). Else None."""


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine running the current policy weights."""

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (set by :meth:`update_weights`)."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        n: int = 1,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions of each prompt: ``out[i][j]`` is sample j of prompt i.

        ``seeds`` (optional, one per prompt) replaces ``sampling.seed`` per prompt — callers that batch unrelated
        requests (the agent loop) use it to keep each request reproducible on its own.
        """
        ...

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new policy weights (Hugging Face or Megatron names) and set ``policy_version``."""
        ...


def check_request(prompts: Sequence[Sequence[int]], sampling: SamplingConfig, n: int,
                  seeds: Sequence[int] | None, *, max_len: int, max_len_name: str,
                  can_stop_on_strings: bool, stop_strings_hint: str) -> None:
    """The argument checks every engine's ``generate`` makes before any work (clear errors, nothing started)."""
    if n < 1:
        raise ValueError(f"n must be ≥ 1, got {n}")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if sampling.stop_strings and not can_stop_on_strings:
        raise ValueError(f"stop_strings need {stop_strings_hint}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + sampling.max_new_tokens > max_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {sampling.max_new_tokens} exceed "
                             f"{max_len_name} {max_len}")


_U64 = (1 << 64) - 1


def derive_seed(base: int, *parts: int) -> int:
    """A well-mixed 63-bit seed from ``base`` and coordinates (prompt, sample, turn …): splitmix64 steps.

    Engines seed completion j of prompt i with ``derive_seed(seed, i, j)`` (or ``derive_seed(seeds[i], j)``).
    """
    x = base & _U64
    for p in parts:
        x = (x + 0x9E3779B97F4A7C15 + (p & _U64)) & _U64
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _U64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _U64
        x ^= x >> 31
    return x >> 1


# --------------------------------------------------------------------------------------------------
# Contract check
# --------------------------------------------------------------------------------------------------

ReferenceLogprobs = Callable[[list[int], list[int], float], list[float]]
"""(prompt, completion tokens, temperature) -> the trainer's log-probs of the completion tokens."""


def _check_structure(prompts, out, sampling: SamplingConfig, n: int, vocab_size: int, version: int) -> None:
    assert len(out) == len(prompts), f"{len(out)} result lists for {len(prompts)} prompts"
    stops = set(sampling.stop_token_ids)
    tools = set(sampling.tool_token_ids)
    for i, comps in enumerate(out):
        assert len(comps) == n, f"prompt {i}: {len(comps)} completions, expected n={n}"
        for j, c in enumerate(comps):
            where = f"prompt {i} sample {j}"
            assert isinstance(c, Completion), f"{where}: not a Completion"
            assert 1 <= len(c.token_ids) <= sampling.max_new_tokens, f"{where}: {len(c.token_ids)} tokens"
            assert len(c.logprobs) == len(c.token_ids), f"{where}: logprobs misaligned"
            assert all(0 <= t < vocab_size for t in c.token_ids), f"{where}: token outside the vocabulary"
            assert all(math.isfinite(x) and x <= 1e-6 for x in c.logprobs), f"{where}: bad log-prob"
            assert c.policy_version == version, f"{where}: policy_version {c.policy_version} != {version}"
            enders = stops | tools
            assert not any(t in enders for t in c.token_ids[:-1]), f"{where}: continued past a stop token"
            last = c.token_ids[-1]
            if c.finish_reason == "tool":
                assert last in tools, f"{where}: finish 'tool' without a tool token at the end"
            elif c.finish_reason == "stop":
                assert last in stops or sampling.stop_strings, f"{where}: finish 'stop' without a stop token"
            else:
                assert c.finish_reason == "length", f"{where}: unknown finish_reason {c.finish_reason!r}"
                assert len(c.token_ids) == sampling.max_new_tokens and last not in enders, f"{where}: bad 'length'"
            if sampling.truncates:
                assert c.sampling_logprobs is not None and len(c.sampling_logprobs) == len(c.token_ids)
                assert all(s >= lp - 1e-6 for s, lp in zip(c.sampling_logprobs, c.logprobs)), (
                    f"{where}: truncated log-prob below the untruncated one"
                )
            else:
                assert c.sampling_logprobs is None, f"{where}: sampling_logprobs without truncation"


def _max_logprob_diff(prompts, out, temperature: float, reference: ReferenceLogprobs) -> float:
    worst = 0.0
    for p, comps in zip(prompts, out):
        for c in comps:
            ref = reference(list(p), list(c.token_ids), temperature)
            assert len(ref) == len(c.logprobs)
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, c.logprobs)))
    return worst


def _tokens(out) -> list[list[list[int]]]:
    return [[c.token_ids for c in comps] for comps in out]


def check_engine_contract(
    engine: RolloutEngine,
    *,
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    reference_logprobs: ReferenceLogprobs | None = None,
    atol: float = 1e-5,
    update: tuple[dict[str, Any], ReferenceLogprobs | None] | None = None,
    n: int = 2,
    max_new_tokens: int = 12,
) -> dict[str, float]:
    """Run the engine contract against ``engine``; raise AssertionError on the first violation.

    Checks: result structure and alignment; stop tokens end a completion ("stop"/"tool", kept as last token);
    "length" at ``max_new_tokens``; top-k/top-p bookkeeping; seeded reproducibility (also per-prompt ``seeds``,
    independent of batch composition); log-probs within ``atol`` of ``reference_logprobs`` at T=1 and T=0.7;
    with ``update=(new_state_dict, new_reference)``: ``update_weights`` bumps ``policy_version``, changes the
    samples, and log-probs match the new reference. Returns the measured max abs log-prob differences.
    """
    prompts = [list(p) for p in prompts]
    assert len(prompts) >= 2, "the contract needs at least two prompts"
    report: dict[str, float] = {}
    v0 = engine.policy_version
    base = SamplingConfig(max_new_tokens=max_new_tokens, seed=1234)

    out = engine.generate(prompts, base, n=n)
    _check_structure(prompts, out, base, n, vocab_size, v0)
    assert _tokens(engine.generate(prompts, base, n=n)) == _tokens(out), "same seed gave different samples"
    other = engine.generate(prompts, dataclasses.replace(base, seed=4321), n=n)
    assert _tokens(other) != _tokens(out), "different seeds gave identical samples"
    # Per-prompt seeds: a prompt's samples must not depend on the other prompts in the batch.
    seeded = engine.generate(prompts, base, n=1, seeds=[7 + i for i in range(len(prompts))])
    alone = engine.generate(prompts[1:2], base, n=1, seeds=[8])
    assert seeded[1][0].token_ids == alone[0][0].token_ids, "per-prompt seed depends on batch composition"

    # Stops: half of the vocabulary ends a completion, quickly and with the right reason.
    half = tuple(range(0, vocab_size, 2))
    odd = tuple(range(1, vocab_size, 2))
    stop_cfg = dataclasses.replace(base, stop_token_ids=half, tool_token_ids=odd[:1])
    stopped = engine.generate(prompts, stop_cfg, n=n)
    _check_structure(prompts, stopped, stop_cfg, n, vocab_size, v0)
    reasons = {c.finish_reason for comps in stopped for c in comps}
    assert "stop" in reasons, f"no completion stopped on a stop token: {reasons}"
    tool_cfg = dataclasses.replace(base, tool_token_ids=half + odd)
    for comps in engine.generate(prompts, tool_cfg, n=1):
        assert comps[0].finish_reason == "tool" and len(comps[0].token_ids) == 1

    trunc = dataclasses.replace(base, temperature=0.7, top_k=8, top_p=0.9)
    _check_structure(prompts, engine.generate(prompts, trunc, n=n), trunc, n, vocab_size, v0)
    greedy = dataclasses.replace(base, top_k=1, seed=None)
    g1, g2 = engine.generate(prompts, greedy, n=1), engine.generate(prompts, greedy, n=1)
    assert _tokens(g1) == _tokens(g2), "greedy (top_k=1) is not deterministic"

    if reference_logprobs is not None:
        report["logprob_max_abs_diff_t1"] = _max_logprob_diff(prompts, out, 1.0, reference_logprobs)
        t07 = dataclasses.replace(base, temperature=0.7)
        report["logprob_max_abs_diff_t0.7"] = _max_logprob_diff(
            prompts, engine.generate(prompts, t07, n=n), 0.7, reference_logprobs
        )
        for k, v in report.items():
            assert v <= atol, f"{k} = {v:.3g} > {atol}"

    if update is not None:
        new_state, new_reference = update
        engine.update_weights(new_state, v0 + 1)
        assert engine.policy_version == v0 + 1, "update_weights did not set policy_version"
        after = engine.generate(prompts, base, n=n)
        _check_structure(prompts, after, base, n, vocab_size, v0 + 1)
        assert _tokens(after) != _tokens(out), "samples unchanged after update_weights (weights not loaded?)"
        if new_reference is not None:
            d = _max_logprob_diff(prompts, after, 1.0, new_reference)
            report["logprob_max_abs_diff_after_update"] = d
            assert d <= atol, f"log-probs after update differ by {d:.3g} > {atol}"
    return report
