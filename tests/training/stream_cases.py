"""Shared builders for the streaming exactness tests (single process and multi-process workers)."""

from __future__ import annotations

import random

import torch

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.model.builder import ModelArch

TINY = ModelArch(family="llama", vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, head_dim=16)


def make_samples(seed: int, *, num_groups: int = 3, reward_kind: str = "binary", zero_var_group: bool = True,
                 ratio_noise: float = 0.0, vocab: int = 256, with_ref: bool = False) -> list[Sample]:
    """Random multi-turn-looking trajectories: prompt, action spans, tool-output gaps (loss_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    out = []
    for k in range(num_groups):
        G = rnd.choice([3, 4, 5])
        zero_var = zero_var_group and k == 0
        for i in range(G):
            T = rnd.randint(10, 24)
            ids = torch.randint(0, vocab, (T,), generator=g)
            mask = torch.zeros(T)
            p = rnd.randint(2, 4)
            mask[p:] = 1
            if T - p > 6:  # a tool-output span inside
                a = rnd.randint(p + 2, T - 3)
                mask[a : a + 2] = 0
            if zero_var:
                r = 0.7 if reward_kind != "binary" else 1.0
            elif reward_kind == "binary":
                r = float(rnd.random() < 0.5)
            elif reward_kind == "bounded":
                r = round(rnd.random(), 3)
            else:
                r = rnd.gauss(0.0, 3.0) + 1000.0 * (k == 1)
            beh = -torch.rand(T, generator=g, dtype=torch.float64) * 3 - 1.0
            ref = -torch.rand(T, generator=g, dtype=torch.float64) * 3 - 1.0 if with_ref else None
            out.append(Sample(traj_id=f"g{k}t{i}", group_id=f"g{k}", group_size=G, token_ids=ids,
                              loss_mask=mask, reward=r, behaviour_logp=beh, ref_logp=ref))
    return out


def spec_for(kind: str) -> RewardSpec:
    return {"binary": RewardSpec.binary(0.0, 1.0), "bounded": RewardSpec.bounded(0.0, 1.0),
            "continuous": RewardSpec.continuous()}[kind]


def arrival_order(samples: list[Sample], seed: int) -> list[Sample]:
    order = list(samples)
    random.Random(seed).shuffle(order)
    return order


def frontier_order(samples: list[Sample], seed: int) -> list[Sample]:
    """The order frontier-first rollouts (--rollout-frontier-first) aim at: the step's groups land in batch order,
    each group's members in a random order among themselves (one group open at a time)."""
    pos = {g: k for k, g in enumerate(dict.fromkeys(s.group_id for s in samples))}
    return sorted(arrival_order(samples, seed), key=lambda s: pos[s.group_id])


def prompt_groups(seed: int, groups: int = 3, G: int = 4, prompt: int = 14, vocab: int = 256) -> list[Sample]:
    """Groups of G trajectories with one prompt each (loss mask 0), then action spans and tool outputs; group 0 has
    equal rewards; rewards binary."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    out = []
    for k in range(groups):
        p = torch.randint(0, vocab, (prompt + k,), generator=g)
        for i in range(G):
            cont = rnd.randint(6, 16)
            ids = torch.cat([p, torch.randint(0, vocab, (cont,), generator=g)])
            mask = torch.zeros(ids.numel())
            mask[p.numel():] = 1
            if cont > 10:
                mask[p.numel() + 4: p.numel() + 7] = 0  # a tool output inside the continuation
            r = 1.0 if k == 0 else (float(i % 2) if i < 2 else float(rnd.random() < 0.5))  # groups 1.. mixed
            beh = -torch.rand(ids.numel(), generator=g, dtype=torch.float64) * 3 - 1.0
            ref = -torch.rand(ids.numel(), generator=g, dtype=torch.float64) * 3 - 1.0
            out.append(Sample(traj_id=f"g{k}t{i}", group_id=f"g{k}", group_size=G, token_ids=ids, loss_mask=mask,
                              reward=r, behaviour_logp=beh, ref_logp=ref))
    return out


def rel_error(a: dict, b: dict, keys=None) -> float:
    """‖a − b‖ / ‖b‖ over the named tensors of two gradient dicts (``keys``: a subset, e.g. the experts), in float64."""
    keys = list(b) if keys is None else keys
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys) ** 0.5
    return num / sum(float(b[k].double().pow(2).sum()) for k in keys) ** 0.5
