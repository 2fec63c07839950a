"""transformers' GLM-4.7-Flash-style model evaluated in float64 (tests/model/test_glm4_moe_lite.py and
_glm_worker.py): Glm4MoeLite with its four float32 casts lifted, nothing else of its code changed."""

import contextlib

import torch


@contextlib.contextmanager
def float64_transformers(forced=None, family="glm4_moe_lite"):
    """transformers' Glm4MoeLite (``family`` "deepseek_v3": DeepseekV3, the same modeling) modules with their float32
    casts lifted (RMSNorm, RoPE table, router, eager softmax): the same formulas evaluated in float64. ``forced``: a
    list of (T, k) expert indices, one per router call in order, that replace the routers' selection (the weights
    still from the routers' sigmoid scores)."""
    forced = list(forced) if forced is not None else None
    import importlib

    g = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"glm4_moe_lite": "Glm4MoeLite", "deepseek_v3": "DeepseekV3"}[family]
    Norm, Rope, Router = (getattr(g, prefix + n) for n in ("RMSNorm", "RotaryEmbedding", "TopkRouter"))
    saved = {name: getattr(obj, attr) for name, (obj, attr) in {
        "norm": (Norm, "forward"), "rope": (Rope, "forward"),
        "router": (Router, "forward"), "eager": (g, "eager_attention_forward")}.items()}

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        cfg = self.config
        dim = cfg.qk_rope_head_dim
        inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).to(torch.float64) / dim))
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def router(self, h):
        h = h.view(-1, self.hidden_dim)
        self.weight.data = self.weight.data.to(h.dtype)
        logits = torch.nn.functional.linear(h, self.weight)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
        gidx = torch.topk(grouped, k=self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(grouped).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
            -1, self.num_experts)
        idx = torch.topk(choice.masked_fill(~smask.bool(), float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        if forced is not None:
            idx = forced.pop(0).to(idx.device)
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx

    def eager(module, q, k, v, mask, scaling, dropout=0.0, **kw):
        w = torch.matmul(q, k.transpose(2, 3)) * scaling
        if mask is not None:
            w = w + mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    Norm.forward, Rope.forward, Router.forward, g.eager_attention_forward = norm, rope, router, eager
    try:
        yield
    finally:
        Norm.forward, Rope.forward = saved["norm"], saved["rope"]
        Router.forward, g.eager_attention_forward = saved["router"], saved["eager"]


def hf64(path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                              experts_implementation="eager")
    return hf.eval()
