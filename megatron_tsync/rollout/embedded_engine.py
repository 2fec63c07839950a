"""The embedded rollout engine: batched sampling with the policy's own Megatron ``GPTModel`` in-process.

The default engine where there is no GPU (vLLM's CUDA build cannot run). It runs a TP=1 ``GPTModel`` built
by :func:`megatron_tsync.model.builder.build_model` — the same modules as the learner — so its per-token
log-probs equal :func:`megatron_tsync.model.logprobs.token_logprobs` up to float rounding (measured ≤ 1e-6 in
float32).

Why not ``megatron.core.inference``'s static engine (evaluated on the tiny model): it
works on CPU, but (a) its log-probs are of the raw logits at T=1 (wrong for T ≠ 1 and for top-k/top-p),
(b) it has one termination id and string stop words through a detokenizer (no per-request ``</tool>`` /
EOS sets), (c) one global RNG (no per-request seeds), and (d) it needs a text tokenizer object. Its speed is
the same as this sampler's (16 prompts × 32 new tokens, tiny model, 1 thread, CPU time: median ~1.3k tokens/s
for both; full recompute without a cache ~0.45k). We keep its KV cache instead: each step calls
``GPTModel.forward(..., inference_context=StaticInferenceContext)``, megatron's own cached attention.

How a batch runs (``use_kv_cache=True``):

1. Every (prompt, sample) pair is a row. Rows are **left-padded** to the longest prompt, so all prompts end in
   the same slot and decode writes one shared cache slot per step (what the static context supports). Pad
   keys are hidden by an explicit boolean attention mask ``(R, 1, q, k)`` (True = masked), which the local
   layer spec's ``DotProductAttention`` applies as given. RoPE uses absolute slots, so a row's positions are
   shifted by its pad length; attention depends only on position differences, so this changes nothing but
   rounding (≤ 1e-6 measured).
2. Prefill the prompts in one forward; then one token per step for every live row.
3. Rows that finish (stop token, tool token, stop string, ``max_new_tokens``) are dropped from the batch and
   from the KV cache (the cache tensors are re-indexed to the live rows), so the batch shrinks as sequences end.
4. Sampling: ``softmax(logits / T)``, then optional top-k / top-p truncation, then a draw from each row's own
   ``random.Random`` uniform, inverted through the CDF (seeded per row, so results do not depend on batch
   composition; one Python float per row and step instead of R generator calls into torch).

``use_kv_cache=False`` recomputes the whole sequence each step (the fallback measured against; same masks).

KV reuse across turns (``sessions=``, one handle per row; the agent loop passes one per trajectory): when a row
finishes, its keys and values (megatron stores them before RoPE, so they do not depend on the slot) are kept under
its session (``rollout/kv_sessions.py``), with the token ids they are of. A later request of the same session whose
prompt extends those tokens gets them copied into its slots of the new batch's cache; the prefill then runs only
over the last ``q`` slots, ``q`` the longest uncached part of any row of the batch (a row with less to prefill
recomputes some of its cached positions in that window: the same values up to rounding). Entries are dropped when
the weights change (another policy version), when the session is released (the trajectory ended), and least
recently used first beyond ``kv_reuse_bytes`` of cached keys and values. Reuse is off (full prefill, as before)
for models whose layers keep other state than plain K/V in the cache: Qwen3.5's gated-delta layers (a recurrent
state that the window's recomputed positions would advance twice) and GLM's multi-latent attention (a compressed
cache of its own layout); and with ``record_routing`` (router replay needs each position's expert choice from the
forward that first computed it, which the recomputed window would muddle).

Deviations / limits: TP=1, one pipeline stage. Agreement with the trainer: float32 ≤ 2e-6, float64 ~1e-15
measured; bf16 only to bf16 precision. The explicit-mask path is verified with the local layer spec (the
CPU path) only; under Transformer Engine's attention it is untested — GPU runs use the vLLM engine.
"""

from __future__ import annotations

import functools
import random
import threading
from typing import Any, Callable, Sequence

import torch

from megatron_tsync.rollout.engine import Completion, SamplingConfig, check_request, derive_seed
from megatron_tsync.rollout.kv_sessions import KVEntry, SessionKVStore

def temperature_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) with the trainer's formula (``vocab_parallel_logprobs`` at TP=1): (R, V) -> (R, V)."""
    if temperature != 1.0:
        logits = logits / temperature
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()


def truncate_logprobs(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Renormalised log-probs after top-k then top-p filtering (removed tokens get -inf): (R, V) -> (R, V)."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]  # (R, 1)
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, idx = torch.sort(logp, dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_lp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def sample_inverse_cdf(logp: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """One draw per row from ``exp(logp)`` by inverting the CDF at the row's uniform in [0, 1): (R, V) -> (R,).

    The CDF is accumulated in float64 and the uniform is scaled by its total, so a token of probability 0
    (truncated by top-k/top-p) can never be drawn.
    """
    cdf = logp.double().exp().cumsum(dim=-1)  # (R, V)
    u = torch.tensor(uniforms, dtype=torch.float64, device=logp.device) * cdf[:, -1]  # (R,)
    return torch.searchsorted(cdf, u[:, None], right=True)[:, 0]


class _Rows:
    """Book-keeping of one generate call: per-row outputs, and which rows are still live."""

    def __init__(self, n_rows: int, sampling: SamplingConfig, hits_stop_string: Callable[[list[int]], bool] | None):
        self.ids = list(range(n_rows))  # original index of each live row, in batch order
        self.tokens: list[list[int]] = [[] for _ in range(n_rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(n_rows)]
        self.sampling_logprobs: list[list[float]] = [[] for _ in range(n_rows)]
        self.finish: list[str | None] = [None] * n_rows
        self.sampling = sampling
        self.stops, self.tools = set(sampling.stop_token_ids), set(sampling.tool_token_ids)
        self.hits_stop_string = hits_stop_string if sampling.stop_strings else None

    def record(self, new: list[int], lp: list[float], slp: list[float] | None) -> list[int]:
        """Append one token per live row; returns the batch positions of the rows that go on."""
        keep = []
        for k, orig in enumerate(self.ids):
            t = new[k]
            self.tokens[orig].append(t)
            self.logprobs[orig].append(lp[k])
            if slp is not None:
                self.sampling_logprobs[orig].append(slp[k])
            reason = None
            if t in self.tools:
                reason = "tool"
            elif t in self.stops or (self.hits_stop_string is not None and self.hits_stop_string(self.tokens[orig])):
                reason = "stop"
            elif len(self.tokens[orig]) >= self.sampling.max_new_tokens:
                reason = "length"
            if reason is None:
                keep.append(k)
            else:
                self.finish[orig] = reason
        return keep

    def completions(self, version: int) -> list[Completion]:
        trunc = self.sampling.truncates
        return [
            Completion(
                token_ids=self.tokens[r],
                logprobs=self.logprobs[r],
                finish_reason=self.finish[r],  # type: ignore[arg-type]
                sampling_logprobs=self.sampling_logprobs[r] if trunc else None,
                policy_version=version,
            )
            for r in range(len(self.tokens))
        ]


class _RoutingLog:
    """Per row of one generate call, the experts the MoE layers chose at each slot the engine computed."""

    def __init__(self, n_rows: int, num_experts: int):
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(n_rows)]
        self.dtype = torch.uint8 if num_experts <= 256 else torch.int16
        self.started = False

    def add(self, indices: list[torch.Tensor], q: int, rows: list[int], *, last_only: bool) -> None:
        """``indices``: per layer (q·r, k) in megatron's (S, B) token order, for ``rows`` (original indices)."""
        x = torch.stack([i.view(q, len(rows), -1) for i in indices], dim=2).to(self.dtype)  # (q, r, L, k)
        if last_only:  # a recompute step (no KV cache): only its last slot is new
            x = x[-1:]
        for j, orig in enumerate(rows):
            self.chunks[orig].append(x[:, j])
        self.started = True

    def result(self, row: int, pad: int):
        """(P, L, k) numpy array of the row's real positions (its left padding dropped)."""
        return torch.cat(self.chunks[row])[pad:].cpu().numpy()


class EmbeddedEngine:
    """Batched sampler over an in-process Megatron ``GPTModel`` (TP=1). Implements ``RolloutEngine``.

    Args:
        model: a single-stage ``GPTModel`` (e.g. from ``build_model``); the engine owns it (puts it in eval mode
            and loads new weights into it in place).
        max_batch_rows: rows (prompts × n) per forward; larger requests run in chunks.
        use_kv_cache: False recomputes every step from scratch (slow; for cross-checks).
        detokenize: ids -> text, needed only for ``SamplingConfig.stop_strings``.
        version: initial ``policy_version``.
        record_routing: MoE models (built with ``moe_enable_routing_replay=True``; ``from_arch`` does that):
            every completion carries ``routing``, the experts chosen at each position in the forward that first
            computed it (prefill for the prompt, the decode step for each generated token), for router replay.
        kv_reuse_bytes: bytes of finished rows' K/V kept for their sessions (all sessions together; least
            recently used evicted first; the tiny model's 2,000-token trajectory takes ~2 MB in float32); 0 turns
            KV reuse across turns off (see the module docstring).
    """

    def __init__(
        self,
        model,
        *,
        max_batch_rows: int = 64,
        use_kv_cache: bool = True,
        detokenize: Callable[[list[int]], str] | None = None,
        version: int = 0,
        record_routing: bool = False,
        kv_reuse_bytes: int = 1 << 30,
    ):
        from megatron_tsync.model.builder import unwrap

        self.model = unwrap(model)
        self.model.eval()
        self.arch = getattr(self.model, "arch", None)
        self.max_batch_rows = int(max_batch_rows)
        self.use_kv_cache = bool(use_kv_cache)
        self.detokenize = detokenize
        self._version = int(version)
        self._lock = threading.Lock()  # one generate / update at a time
        self._thread_ready = threading.local()
        self._param = next(self.model.parameters())
        cfg = self.model.config
        if getattr(cfg, "tensor_model_parallel_size", 1) != 1 or not (self.model.pre_process and self.model.post_process):
            raise ValueError("EmbeddedEngine needs a TP=1, single-stage GPTModel")
        self.max_seq_len = int(getattr(self.model, "max_sequence_length", 0) or 4096)
        self.vocab_size = int(self.model.vocab_size)
        self.record_routing = bool(record_routing)
        if self.record_routing and not getattr(cfg, "num_moe_experts", None):
            raise ValueError("record_routing needs a MoE model (this one has no experts)")
        self.sessions = SessionKVStore(kv_reuse_bytes)
        self.prefill_positions = 0  # (row, position) pairs the prefills forwarded: KV reuse's work saved shows here
        plain_kv = all(type(layer.self_attention).__name__ == "SelfAttention" for layer in self.model.decoder.layers)
        self.supports_sessions = bool(kv_reuse_bytes) and self.use_kv_cache and not self.record_routing and plain_kv

    @classmethod
    def from_arch(cls, arch, precision=None, *, seed: int | None = 0, **kwargs) -> "EmbeddedEngine":
        """Build the policy's architecture (TP=1; parallel state must be initialised) and wrap it."""
        from megatron_tsync.model.builder import build_model

        replay = {"moe_enable_routing_replay": True} if kwargs.get("record_routing") else {}
        return cls(build_model(arch, precision, seed=seed, **replay), **kwargs)

    @classmethod
    def from_hf_dir(cls, path: str, precision=None, **kwargs) -> "EmbeddedEngine":
        """Build the architecture of a Hugging Face folder (Llama, Qwen2, Qwen3, Qwen3-MoE) and load its weights."""
        from megatron_tsync.model.hf_conversion import load_hf_dir

        arch, state = load_hf_dir(path)
        engine = cls.from_arch(arch, precision, seed=0, **kwargs)
        engine.update_weights(state, kwargs.get("version", 0))
        return engine

    # ------------------------------------------------------------------ protocol
    @property
    def policy_version(self) -> int:
        return self._version

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load weights given with Megatron names (``model.state_dict()``) or Hugging Face names, in place."""
        with self._lock, torch.no_grad():
            own = self.model.state_dict()
            sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
            if any(k in own for k in sd):
                missing = [k for k, v in own.items() if torch.is_tensor(v) and "_extra_state" not in k and k not in sd]
                if missing:
                    raise KeyError(f"megatron state dict lacks {len(missing)} weights, e.g. {missing[:3]}")
                for k, v in sd.items():
                    if k in own and torch.is_tensor(v) and "_extra_state" not in k:
                        own[k].copy_(v.to(own[k].dtype))
            else:
                try:
                    from megatron_tsync.model.hf_conversion import load_hf_into_model
                except ImportError as e:  # pragma: no cover - depends on the conversion module being present
                    raise ImportError("Hugging Face weights need megatron_tsync.model.hf_conversion") from e
                load_hf_into_model(self.model, sd)
            self._version = int(version)
            self.sessions.clear()  # every cached key and value is of the old weights

    def release_session(self, session) -> None:
        """Drops a session's cached K/V (its trajectory ended); unknown sessions are ignored."""
        self.sessions.release(session)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        n: int = 1,
        *,
        seeds: Sequence[int] | None = None,
        interrupt: Callable[[], bool] | None = None,
        prefill_hook: Callable[[int, torch.Tensor], list[bool]] | None = None,
        sessions: Sequence[Any] | None = None,
    ) -> list[list[Completion]]:
        """Two extras, not part of the engine protocol, for speculative rollouts. ``interrupt``: checked before every
        decode step; once it returns True the call ends, every unfinished row with ``finish_reason`` None (drafting
        stops so the moment new weights land). ``prefill_hook(first_row, logits)``: called with the prefill's raw
        logits of every prompt position, (rows, L, V) for rows ``first_row ..`` of the request, prompts left-padded to
        L (so row r's last n prompt tokens are the last n positions); it returns, per row, whether to go on
        generating — a row that does not gets no token (verification scores a draft in the prompt's prefill and
        keeps decoding, with the same cache, only where the whole draft was kept). ``sessions``: one hashable handle
        (or None) per prompt, ``n`` = 1: KV reuse across calls of the same session (module docstring)."""
        check_request(prompts, sampling, n, seeds, max_len=self.max_seq_len,
                      max_len_name="the model's max_position_embeddings",
                      can_stop_on_strings=self.detokenize is not None,
                      stop_strings_hint="an engine built with detokenize=...")
        if sessions is not None and (len(sessions) != len(prompts) or n != 1 or prefill_hook is not None):
            raise ValueError(f"sessions: one per prompt ({len(sessions)} for {len(prompts)}), with n=1 (got "
                             f"{n}) and no prefill_hook")
        if not self.supports_sessions:
            sessions = None
        rows: list[tuple[list[int], random.Random, Any]] = []
        for i, p in enumerate(prompts):
            for j in range(n):
                if seeds is not None:
                    g = random.Random(derive_seed(int(seeds[i]), j))
                elif sampling.seed is not None:
                    g = random.Random(derive_seed(int(sampling.seed), i, j))
                else:
                    g = random.Random()  # seeded from the OS: not reproducible, by request
                rows.append(([int(t) for t in p], g, None if sessions is None else sessions[i]))
        results: list[Completion] = []
        self._ensure_thread()
        with self._lock:
            version = self._version
            for s in range(0, len(rows), self.max_batch_rows):
                hook = None if prefill_hook is None else functools.partial(prefill_hook, s)
                results.extend(self._generate_rows(rows[s : s + self.max_batch_rows], sampling, version, interrupt,
                                                   hook))
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]], first: Sequence[int]) -> list[torch.Tensor]:
        """Raw logits predicting tokens ``first[i] .. len(seqs[i])`` of each sequence — (len − first + 1, V) float32,
        the last row the distribution of the token after the sequence — from one forward per chunk of rows (no
        cache; left-padded like ``generate``, so the same rounding). What speculative verification scores with."""
        out: list[torch.Tensor] = []
        self._ensure_thread()
        dev = self._param.device
        with self._lock:
            for s in range(0, len(seqs), self.max_batch_rows):
                chunk, starts = seqs[s : s + self.max_batch_rows], first[s : s + self.max_batch_rows]
                lens = torch.tensor([len(q) for q in chunk])
                L = int(lens.max())
                tokens = torch.zeros(len(chunk), L, dtype=torch.long, device=dev)
                for r, q in enumerate(chunk):
                    tokens[r, L - len(q) :] = torch.tensor(list(q), dtype=torch.long)
                key_pad = torch.arange(L, device=dev)[None, :] < (L - lens).to(dev)[:, None]
                mask = torch.ones(L, L, dtype=torch.bool, device=dev).triu(1)[None] | key_pad[:, None, :]
                logits = self.model(tokens, torch.zeros_like(tokens), mask[:, None]).float()  # (R, L, V)
                for r, (q, f) in enumerate(zip(chunk, starts)):
                    if not 1 <= f <= len(q):
                        raise ValueError(f"score: first={f} outside 1..{len(q)} for a sequence of {len(q)} tokens")
                    out.append(logits[r, L - len(q) + f - 1 :].clone())
        return out

    # ------------------------------------------------------------------ internals
    def _ensure_thread(self) -> None:
        """megatron's CPU support (a torch function mode) is per thread: enter it once in each calling thread."""
        if not getattr(self._thread_ready, "done", False):
            from megatron_tsync.model import compat

            if threading.current_thread() is not threading.main_thread():
                compat.ensure_cpu_mode_in_thread()
            self._thread_ready.done = True

    def _forward(self, tokens, mask, ctx, routes=None, rows=None, full=False):
        """(R, q) tokens, (R, 1, q, k) bool mask -> (R, V) logits of the last position ((R, q, V), every position,
        with ``full``). With ``routes`` (a :class:`_RoutingLog`) the experts chosen for these q slots of ``rows`` are
        logged."""
        if routes is not None:
            from megatron_tsync.model.moe import record_routing

            with record_routing(self.model) as rec:
                out = self._forward(tokens, mask, ctx, full=full)
            routes.add(rec.indices, tokens.shape[1], rows, last_only=ctx is None and routes.started)
            return out
        pos = torch.zeros_like(tokens)  # RoPE positions come from the cache slots; learned positions unused
        if ctx is None:
            logits = self.model(tokens, pos, mask)  # (R, q, V)
            return logits if full else logits[:, -1, :]
        logits = self.model(tokens, pos, mask, inference_context=ctx, runtime_gather_output=True)  # (R, 1 or q, V)
        ctx.increment_sequence_len_offset(tokens.shape[1])
        return logits if full else logits[:, -1, :]

    def _generate_rows(self, rows, sampling: SamplingConfig, version: int, interrupt=None,
                       prefill_hook=None) -> list[Completion]:
        from megatron.core.inference.contexts import StaticInferenceContext

        R = len(rows)
        lens = torch.tensor([len(p) for p, _, _ in rows])
        L = int(lens.max())
        S = L + sampling.max_new_tokens
        dev = self._param.device
        tokens = torch.zeros(R, S, dtype=torch.long, device=dev)  # (R, S) prompts left-padded to L
        for r, (p, _, _) in enumerate(rows):
            tokens[r, L - len(p) : L] = torch.tensor(p, dtype=torch.long)
        key_pad = torch.arange(S, device=dev)[None, :] < (L - lens).to(dev)[:, None]  # (R, S) True = pad key
        rngs = [g for _, g, _ in rows]
        st = _Rows(R, sampling, functools.partial(self._hits_stop_string, sampling.stop_strings))
        ctx = StaticInferenceContext(R, S) if self.use_kv_cache else None
        routes = _RoutingLog(R, self.model.config.num_moe_experts) if self.record_routing else None
        if prefill_hook is not None and ctx is not None:
            ctx.materialize_only_last_token_logits = False  # the hook reads every prompt position
        q = self._place_cached(rows, lens, L, S, ctx, version) if ctx is not None else L  # slots to prefill
        self.prefill_positions += q * R
        causal = torch.ones(q, L, dtype=torch.bool, device=dev).triu(L - q + 1)  # (q, L) True = future
        logits = self._forward(tokens[:, L - q : L], (causal[None] | key_pad[:, None, :L])[:, None], ctx,
                               routes, list(range(R)), full=prefill_hook is not None)  # (R, V), (R, L, V) full
        live = torch.arange(R, device=dev)  # rows of `tokens` still generating, in batch order
        if prefill_hook is not None:
            go = [r for r, ok in enumerate(prefill_hook(logits)) if ok]
            logits = logits[:, -1, :]
            if ctx is not None:
                ctx.materialize_only_last_token_logits = True
            if not go:
                return st.completions(version)
            if len(go) < R:  # rows the hook ended: no token, dropped from the batch and the cache like finished ones
                kt = torch.tensor(go, device=dev)
                live, logits, st.ids = live[kt], logits[kt], go
                if ctx is not None:
                    for layer, (km, vm) in list(ctx.key_value_memory_dict.items()):
                        ctx.key_value_memory_dict[layer] = (km[:, kt], vm[:, kt])
        if ctx is not None:
            ctx.enable_decode_mode()
        cur = L  # next slot to fill
        while True:
            if logits.dtype in (torch.bfloat16, torch.float16):
                logits = logits.float()
            logp = temperature_logprobs(logits, sampling.temperature)  # (r, V)
            samp_lp = truncate_logprobs(logp, sampling.top_k, sampling.top_p) if sampling.truncates else logp
            new = sample_inverse_cdf(samp_lp, [rngs[orig].random() for orig in st.ids])  # (r,)
            lp = logp.gather(-1, new[:, None])[:, 0].tolist()
            slp = samp_lp.gather(-1, new[:, None])[:, 0].tolist() if sampling.truncates else None
            keep = st.record(new.tolist(), lp, slp)
            tokens[live, cur] = new
            cur += 1
            if not keep or (interrupt is not None and interrupt()):
                self._keep_sessions(ctx, list(enumerate(st.ids)), rows, st, L, cur - 1, version)
                break
            if len(keep) < len(st.ids):  # drop finished rows from the batch and from the KV cache
                done = set(keep)
                self._keep_sessions(ctx, [(k, o) for k, o in enumerate(st.ids) if k not in done], rows, st, L,
                                    cur - 1, version)
                kt = torch.tensor(keep, device=dev)
                live = live[kt]
                st.ids = [st.ids[k] for k in keep]
                if ctx is not None:
                    for layer, (km, vm) in list(ctx.key_value_memory_dict.items()):
                        ctx.key_value_memory_dict[layer] = (km[:, kt], vm[:, kt])  # (S, r, g, d)
            if ctx is not None:
                logits = self._forward(tokens[live, cur - 1 : cur], key_pad[live, None, None, :cur], ctx,
                                       routes, st.ids)
            else:
                full = torch.ones(cur, cur, dtype=torch.bool, device=dev).triu(1)[None] | key_pad[live, None, :cur]
                logits = self._forward(tokens[live, :cur], full[:, None], None, routes, st.ids)
        out = st.completions(version)
        if routes is not None:
            for r, c in enumerate(out):
                c.routing = routes.result(r, L - int(lens[r]))
        return out

    def _place_cached(self, rows, lens, L: int, S: int, ctx, version: int) -> int:
        """Copies each session row's cached K/V (``sessions.lookup``) into its slots of a fresh batch cache and
        sets the context's offset so that the prefill covers only the last ``q`` slots; returns ``q`` (``L``: no
        row had a cached prefix, the ordinary full prefill)."""
        hits = [(0, None) if s is None else self.sessions.lookup(s, p, version) for p, _, s in rows]
        if not any(e is not None for _, e in hits):
            return L
        q = max(int(lens[r]) - c for r, (c, _) in enumerate(hits))
        proto = next(e for _, e in hits if e is not None)
        dev = self._param.device
        for layer, (k0, v0) in proto.layers.items():
            km = torch.zeros(S, len(rows), *k0.shape[1:], dtype=k0.dtype, device=dev)  # (S, R, g, d)
            vm = torch.zeros(S, len(rows), *v0.shape[1:], dtype=v0.dtype, device=dev)
            for r, (c, e) in enumerate(hits):
                if e is not None:
                    a = L - int(lens[r])
                    km[a : a + c, r] = e.layers[layer][0][:c]
                    vm[a : a + c, r] = e.layers[layer][1][:c]
            ctx.key_value_memory_dict[layer] = (km, vm)
        ctx.sequence_len_offset = L - q
        return q

    def _keep_sessions(self, ctx, done, rows, st: _Rows, L: int, end: int, version: int) -> None:
        """Stores the K/V of finished session rows: ``done`` lists (batch position, original row); each row's real
        slots ``L − len(prompt) .. end − 1`` (its last sampled token was never forwarded, so it is not cached)."""
        if ctx is None or not self.supports_sessions:
            return
        for k, orig in done:
            prompt, _, session = rows[orig]
            if session is None:
                continue
            a = L - len(prompt)
            layers = {layer: (km[a:end, k].clone(), vm[a:end, k].clone())
                      for layer, (km, vm) in ctx.key_value_memory_dict.items()}
            self.sessions.put(session, KVEntry(prompt + st.tokens[orig][: end - L], layers, version))

    def _hits_stop_string(self, stop_strings: tuple[str, ...], toks: list[int]) -> bool:
        """Whether the text of the last 32 generated tokens contains a stop string (checked after every token)."""
        tail = self.detokenize(toks[-32:])  # type: ignore[misc]
        return any(s in tail for s in stop_strings)
