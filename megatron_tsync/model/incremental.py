"""Incremental (KV-kept) forward of a megatron ``GPTModel`` stage over a growing sequence.

Used by the OPD learner (turn-level streaming with the earlier turns' keys/values kept in the autograd graph) and by
the teacher scorer (under ``torch.no_grad``: a plain KV-cached scorer). Qwen3.5's linear-attention layers
(model/gdn_layer.py) keep their conv window and recurrent state instead of K/V (``extend``); multi-latent attention
(model/mla.py, GLM-4.7-Flash) takes q/k/v from megatron's own ``MLASelfAttention`` projections, rotated at the
chunk's positions (:class:`_RopeAt`), and keeps its up-projected K/V like the other layers. The embedded rollout
engine generates with megatron-core's own inference KV cache instead (``rollout/embedded_engine.py``). Activation
recomputation of the model's config (``--recompute-granularity``) applies here too, under grad:
:func:`recompute_plan` picks the layers megatron's block would checkpoint and each chunk checkpoints them with
torch's non-reentrant checkpoint.
"""

from __future__ import annotations

import functools
import math

import torch

from megatron_tsync.model.builder import unwrap


class IncrementalGPT:
    """Forward of one pipeline stage of a megatron ``GPTModel`` over a growing sequence (batch 1).

    ``extend(ids_new, start)`` runs this stage's layers on the new tokens only, attending to the K/V of all earlier
    tokens, which are kept as ordinary autograd tensors (no in-place cache): under grad the chunks share one graph,
    under ``torch.no_grad`` it is a plain KV-cached scorer (the teacher). The first stage embeds ``ids_new``; a later
    stage takes the previous stage's output for the same tokens as ``hidden`` (s, 1, h). Returns the stage's output
    before the final norm, (s, 1, h); on the last stage ``head(h)`` applies final norm + output layer:
    (s, 1, h) -> (1, s, V/tp). The p2p between stages is ``training.opd_pipeline``'s.

    Sequence parallelism (a MoE model at TP > 1, ``model.moe``): ``extend`` pads the chunk at the end to a multiple
    of TP (token 0, positions continuing; a later stage pads ``hidden`` with zeros) and runs the layers on this
    rank's sequence shard as the full forward does (the column-parallel QKV gathers the sequence, the row-parallel
    projection scatters it back; causal: no real token sees the padding). Only the real tokens' K/V are kept, so a
    later chunk never attends to padding; the output is gathered and cut to the s real rows, the same on every TP
    rank (its backward keeps each rank's own rows). ``head`` pads and shards alike and drops the padding's logits.
    In and out, ``extend``/``head`` see full, unpadded (s, 1, h) tensors: the callers and the PP p2p are as at
    TP = 1. Router replay: ``model.moe.replay_microbatch`` shards a chunk's (s, k) routing padded alike.
    """

    def __init__(self, model, *, whole: bool = True):
        self.m = unwrap(model)
        if whole and not (self.m.pre_process and self.m.post_process):
            raise ValueError("IncrementalGPT(whole=True) needs the whole model on one pipeline stage (PP = 1)")
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (sk, 1, ng, hn) each
        self.length = 0

    def extend(self, ids_new: torch.Tensor, start: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if start != self.length:
            raise ValueError(f"chunk starts at {start}, but {self.length} tokens were seen")
        m, s = self.m, int(ids_new.shape[0])
        dev = next(m.parameters()).device
        sp = self._sp()
        n = s + (-s) % sp  # under sequence parallelism the chunk is padded at the end to a multiple of TP
        if m.pre_process:
            ids = ids_new.to(dev).long()
            ids = (ids if n == s else torch.cat([ids, ids.new_zeros(n - s)])).unsqueeze(0)  # (1, n): padding token 0
            pos = torch.arange(start, start + n, device=dev).unsqueeze(0)  # (1, n)
            x = m.embedding(input_ids=ids, position_ids=pos)  # (n/sp, 1, h): this rank's sequence shard under SP
        elif hidden is None or hidden.shape[0] != s:
            raise ValueError(f"a later pipeline stage needs the previous stage's output for the {s} new tokens")
        else:
            x = _shard(_pad_rows(hidden, n), sp)  # (n/sp, 1, h)
        mla = getattr(m.config, "multi_latent_attention", False)  # each MLA layer owns its rotary module
        freqs = None if mla else m.rotary_pos_emb(start + n)[start:]  # (n, 1, 1, d); the model's inv_freq
        qi = torch.arange(start, start + n, device=dev).unsqueeze(1)
        masked = (torch.arange(start + n, device=dev).unsqueeze(0) > qi).view(1, n, start + n)  # (1, n, sk)
        plan = recompute_plan(m.config, len(m.decoder.layers)) if torch.is_grad_enabled() else {}
        for li, layer in enumerate(m.decoder.layers):
            prev = self.kv[li] if li < len(self.kv) else None

            def run(x, layer=layer, prev=prev, selective=plan.get(li) == "attention"):
                attn = layer.self_attention
                h = layer.input_layernorm(x)
                if hasattr(attn, "extend"):  # linear attention (model/gdn_layer.py): its recurrent state is the cache
                    out, (tail, state) = attn.extend(h, prev)
                    x = x + out
                    out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
                    return x + (out if bias is None else out + bias), tail, state
                gate = None
                if mla:  # q (n,1,np,nope+rope), k alike (the shared rope key expanded), v (n,1,np,v_head)
                    q, k, v = attn.get_query_key_value_tensors(h, inference_context=_RopeAt(start, n))[:3]
                    return _attend(layer, attn, x, q, k, v, prev, masked, selective)
                # applies the per-head q/k layernorms too (Qwen3 QK-norm), before RoPE as in the full forward; under
                # SP the column-parallel QKV all-gathers the sequence: q/k/v cover all n new tokens (local heads)
                if attn.config.attention_output_gate:  # Qwen3.5: o · σ(gate) before linear_proj
                    q, k, v, gate = attn.get_query_key_value_tensors(h, output_gate=True)
                else:
                    q, k, v = attn.get_query_key_value_tensors(h)  # (n, 1, np, hn), (n, 1, ng, hn) ×2
                cp = getattr(getattr(attn, "pg_collection", None), "cp", None)
                q = apply_rotary_pos_emb(q, freqs, config=attn.config, cp_group=cp)
                k = apply_rotary_pos_emb(k, freqs, config=attn.config, cp_group=cp)
                return _attend(layer, attn, x, q, k, v, prev, masked, selective, gate)

            x, k, v = _checkpoint(run, x) if plan.get(li) == "layer" else run(x)
            linear = hasattr(layer.self_attention, "extend")  # (conv tail, recurrent state) as they are
            kept = (k, v) if linear else (k[:start + s], v[:start + s])  # views: the padding's K/V are not kept
            if prev is not None:
                self.kv[li] = kept
            else:
                self.kv.append(kept)
        self.length += s
        return _unshard(x, sp)[:s]  # (s, 1, h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        m, s = self.m, int(h.shape[0])
        sp = self._sp()
        n = s + (-s) % sp
        h = _shard(_pad_rows(h, n), sp)  # (n/sp, 1, h)
        h = m.decoder.final_layernorm(h)
        w = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=w)  # (n, 1, V/tp): under SP the output layer gathers the sequence
        return logits[:s].transpose(0, 1)  # (1, s, V/tp)

    def _sp(self) -> int:
        """TP size under sequence parallelism (the stage's activations between layers are sequence shards), else 1."""
        cfg = self.m.config
        return cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1


class _RopeAt:
    """What megatron-core's ``MLASelfAttention.get_query_key_value_tensors`` reads of an inference context: it
    rotates the n new tokens at positions ``start .. start + n - 1`` (its rotary table of ``max_sequence_length``
    rows, sliced from ``sequence_len_offset``), the positions the full forward gives them. Nothing is cached in it:
    the K/V (MLA's up-projected keys and values) are kept by :class:`IncrementalGPT` as for the other layers."""

    def __init__(self, start: int, n: int):
        self.sequence_len_offset = start
        self.max_sequence_length = start + n


def _attend(layer, attn, x, q, k, v, prev, masked, selective, gate=None):
    """The rest of one layer after q/k/v of the new tokens: the kept K/V prepended, causal attention, the output
    projection (and gate), the MLP. Returns (x, k, v) with k/v of all tokens so far."""
    if prev is not None:
        k, v = torch.cat([prev[0], k]), torch.cat([prev[1], v])  # (start + n, 1, ng, hn)
    core = functools.partial(_attention, masked=masked, scale=_softmax_scale(attn))
    ctx = _checkpoint(core, q, k, v) if selective else core(q, k, v)  # (n, 1, np·hv); causal: real rows skip padding
    if gate is not None:
        ctx = attn._apply_output_gate(ctx, gate)
    out, bias = attn.linear_proj(ctx)  # under SP: reduce-scattered back to the rank's shard
    x = x + (out if bias is None else out + bias)
    out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
    return x + (out if bias is None else out + bias), k, v


def recompute_plan(config, num_layers: int) -> dict[int, str]:
    """Which of this stage's layers the incremental forward recomputes in the backward, from megatron's
    ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` (the same layers megatron's
    ``TransformerBlock`` checkpoints): {layer index: "layer" (full) | "attention" (selective: the core attention)}."""
    gran = getattr(config, "recompute_granularity", None)
    if gran == "selective":
        return dict.fromkeys(range(num_layers), "attention") if "core_attn" in (config.recompute_modules or []) else {}
    if gran != "full":
        return {}
    n = config.recompute_num_layers
    if config.recompute_method == "block":
        return dict.fromkeys(range(min(n, num_layers)), "layer")
    return dict.fromkeys(range(num_layers), "layer")  # uniform: every layer, in chunks of n


def _checkpoint(fn, *args):
    """``fn(*args)`` whose saved tensors are dropped and recomputed in the backward (torch's non-reentrant
    checkpoint: tensors ``fn`` reaches by closure, like the kept K/V, get their gradients as without it)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """(s, 1, h) -> (n, 1, h) with zero rows at the end; ``x`` itself when s == n (no copy: TP = 1)."""
    return x if x.shape[0] == n else torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])


def _shard(x: torch.Tensor, sp: int) -> torch.Tensor:
    """Full (n, 1, h), the same on every TP rank -> this rank's sequence shard (n/sp, 1, h); the backward gathers
    the shards' gradients (every rank gets the full gradient)."""
    if sp == 1:
        return x
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(x)


def _unshard(x: torch.Tensor, sp: int) -> torch.Tensor:
    """This rank's sequence shard (n/sp, 1, h) -> the full (n, 1, h) on every TP rank. What uses it (the head, the
    next pipeline stage) runs alike on every TP rank, so each rank's gradient of it is already the full one: the
    backward keeps the rank's own rows (no sum over TP)."""
    if sp == 1:
        return x
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)


def _softmax_scale(attn) -> float:
    sc = getattr(getattr(attn, "core_attention", None), "softmax_scale", None)
    return float(sc) if sc is not None else 1.0 / math.sqrt(attn.hidden_size_per_attention_head)


def _attention(q, k, v, masked, scale: float) -> torch.Tensor:
    """Causal attention of s new queries over sk cached keys. q (s,1,np,hn), k/v (sk,1,ng,hn), masked (1,s,sk)."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:  # GQA, the layout megatron's DotProductAttention uses
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qh, kh, vh = q[:, 0].transpose(0, 1), k[:, 0].transpose(0, 1), v[:, 0].transpose(0, 1)  # (np, s|sk, hn)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # (np, s, sk)
    probs = torch.softmax(scores.masked_fill(masked, -10000.0), dim=-1)
    ctx = torch.matmul(probs, vh)  # (np, s, hn)
    return ctx.transpose(0, 1).reshape(q.shape[0], 1, -1)  # (s, 1, np·hn)
