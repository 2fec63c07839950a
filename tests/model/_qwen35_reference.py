"""transformers' Qwen3.5 model evaluated in float64 (tests/model/test_qwen35.py and _qwen35_worker.py): Qwen3_5 with
its float32 casts lifted, nothing else of its formulas changed.

transformers computes in float32 whatever the model's dtype: both RMSNorms (``x.float()``, ``.to(float32)``), the
RoPE table (float32 inverse frequencies and angles), the linear-attention decay (``A_log.float()``, ``a.float()``),
the gated delta rule (its torch fallbacks cast q/k/v/g/β to float32) and the eager softmax. The reference lifts
exactly those: the norms, the table and the softmax are the same expressions in the input dtype; the layer's forward
is transformers' ``Qwen3_5GatedDeltaNet.forward`` without a cache and without the two ``.float()``; the rule is
transformers' own step-by-step ``torch_recurrent_gated_delta_rule`` with its float32 cast removed (not
megatron_tsync's chunked form, which the megatron side uses: the comparison pits the two forms against each other).
test_qwen35.py also compares the unmodified transformers model in float32 with megatron in float32.
"""

import contextlib

import torch
import torch.nn.functional as F


def _recurrent64(g, query, key, value, decay, beta):
    """transformers' ``torch_recurrent_gated_delta_rule`` (use_qk_l2norm_in_kernel=True, no initial state) in the
    input dtype: the loop over tokens as transformers writes it."""
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query, key = query.repeat_interleave(hv // hk, dim=2), key.repeat_interleave(hv // hk, dim=2)
    query, key, value, beta, decay = (x.transpose(1, 2).contiguous() for x in (query, key, value, beta, decay))
    query, key = g.l2norm(query, dim=-1, eps=1e-6), g.l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    b, h, t, dk = key.shape
    state = torch.zeros(b, h, dk, value.shape[-1], dtype=value.dtype)
    out = torch.zeros_like(value)
    for i in range(t):
        state = state * decay[:, :, i].exp()[..., None, None]
        kv_mem = (state * key[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (value[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + key[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * query[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def float64_transformers(module: str = "qwen3_5"):
    """transformers' Qwen3_5 (``module`` "qwen3_5_moe": Qwen3_5Moe, whose router's softmax is lifted too) modules
    with their float32 casts lifted (module docstring)."""
    import importlib

    g = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    cls = {name: getattr(g, ("Qwen3_5Moe" if module == "qwen3_5_moe" else "Qwen3_5") + name)
           for name in ("RMSNorm", "RMSNormGated", "TextRotaryEmbedding", "GatedDeltaNet")}
    targets = {"norm": (cls["RMSNorm"], "forward"), "gated": (cls["RMSNormGated"], "forward"),
               "rope": (cls["TextRotaryEmbedding"], "forward"), "gdn": (cls["GatedDeltaNet"], "forward"),
               "eager": (g, "eager_attention_forward")}
    if module == "qwen3_5_moe":
        targets["router"] = (g.Qwen3_5MoeTopKRouter, "forward")
    saved = {name: getattr(obj, attr) for name, (obj, attr) in targets.items()}

    def norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def gated(self, x, gate):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x * F.silu(gate)

    def rope(self, x, position_ids):
        rp = self.config.rope_parameters
        dim = int(self.config.head_dim * rp.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
        freqs = position_ids.expand(3, -1, -1)[..., None].to(torch.float64) * inv
        cos, sin = self.recomposition_frequencies(freqs.cos()), self.recomposition_frequencies(freqs.sin())
        return cos.to(x.dtype), sin.to(x.dtype)

    def gdn(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        assert cache is None, "the reference runs without a cache"
        hidden_states = g.apply_mask_to_padding_states(hidden_states, attention_mask)
        b, t, _ = hidden_states.shape
        mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states).reshape(b, t, -1, self.head_v_dim)
        beta_in, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        mixed = g.causal_conv1d_fn(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                   activation=self.activation).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(b, t, -1, self.head_k_dim), k.reshape(b, t, -1, self.head_k_dim)
        v = v.reshape(b, t, -1, self.head_v_dim)
        decay = -self.A_log.exp() * F.softplus(a + self.dt_bias)  # transformers: A_log.float(), a.float()
        o = _recurrent64(g, q, k, v, decay, beta_in.sigmoid())
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(b, t, -1)
        return self.out_proj(o)

    def eager(module, q, k, v, mask, scaling, dropout=0.0, **kw):
        k, v = g.repeat_kv(k, module.num_key_value_groups), g.repeat_kv(v, module.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * scaling
        if mask is not None:
            w = w + mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    def router(self, h):
        logits = F.linear(h.reshape(-1, self.hidden_dim), self.weight)  # (T, E)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)  # transformers: softmax in float32
        return logits, top / top.sum(dim=-1, keepdim=True), idx

    new = {"norm": norm, "gated": gated, "rope": rope, "gdn": gdn, "eager": eager, "router": router}
    for name, (obj, attr) in targets.items():
        setattr(obj, attr, new[name])  # noqa: B010
    try:
        yield
    finally:
        for name, (obj, attr) in targets.items():
            setattr(obj, attr, saved[name])


def hf_model(path, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    model.config.use_cache = False  # one full forward (the lifted linear-attention forward takes no cache)
    return model
