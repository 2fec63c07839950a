"""Loss aggregation with explicit denominators (streaming_math.md §2; verl ``agg_loss`` conventions).

A per-token loss ℓ (B, T) with loss mask w (B, T) (action tokens only) over a batch of B trajectories, T_i = Σ_t w_it:

| mode                     | batch loss                           | ν_i (before backward) | barrier divisor |
|--------------------------|--------------------------------------|-----------------------|-----------------|
| token-mean               | Σ_i Σ_t w ℓ / N_tok                  | 1                     | N_tok (global)  |
| seq-mean-token-mean      | (1/B) Σ_i (Σ_t w ℓ) / T_i            | 1/(B·T_i)             | 1               |
| seq-mean-token-sum       | (1/B) Σ_i Σ_t w ℓ                    | 1/B                   | 1               |
| seq-mean-token-sum-norm  | (1/B) Σ_i Σ_t w ℓ / L_max            | 1/(B·L_max)           | 1               |

The streamed loss is Σ_i ν_i Σ_t w_t ℓ_t, each trajectory's term backpropagated on its own; the accumulated gradient
is divided once by ``barrier_divisor`` (N_tok all-reduced over DP × CP for token-mean — Megatron's
``calculate_per_token_loss`` + ``finalize_model_grads`` contract) BEFORE gradient clipping and the optimizer step.
Then streamed gradient == ∇ ``aggregate``(...) exactly.

B (``num_sequences``) is the number of trajectories in the whole (mini)batch the step is taken on, across all
data-parallel ranks. L_max (``max_len``) is a constant known before the batch, not a per-microbatch or per-batch
width: the most action tokens one trajectory can have. A run passes its action-token budget
``RLConfig.max_action_tokens`` = min(``--max-turns`` × ``--max-new-tokens``, ``--seq-length``) (Dr.GRPO's
generation budget MAX_TOKENS, per trajectory over all its turns); the exactness tests pass the batch's largest T_i
(``training.learner.shape_for``), which is exact too (any constant ≥ every T_i is: the same ν_i in every mode).
``sequence_weight`` refuses a trajectory with T_i > L_max.

Deviations from verl:

* seq-mean-token-sum-norm divides by B · L_max (Dr.GRPO's "mean over the batch of token-sum / MAX_TOKENS", and
  streaming_math.md §2). verl's ``agg_loss`` divides the *microbatch* token-sum by L_max only and leaves the 1/B to its
  gradient-accumulation scaling; here the whole denominator is explicit.
* A trajectory with T_i = 0 action tokens contributes 0 in seq-mean-token-mean (verl would give 0/0 = NaN) and still
  counts in B. token-mean with N_tok = 0 divides by 1 (the sum is 0).
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATION_MODES", "aggregate", "barrier_divisor", "sequence_weight"]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; known: {AGGREGATION_MODES}")


def sequence_weight(mode: str, num_tokens_i: int, *, num_sequences: int, max_len: int | None = None) -> float:
    """ν_i, the per-trajectory normaliser applied to Σ_t w_t ℓ_t before trajectory i's backward.

    num_tokens_i: T_i, action tokens of trajectory i; num_sequences: B (global batch); max_len: L_max (required for
    seq-mean-token-sum-norm; the module docstring says which constant; ≥ T_i).
    """
    _check_mode(mode)
    if num_tokens_i < 0:
        raise ValueError(f"num_tokens_i must be >= 0, got {num_tokens_i}")
    if mode == "token-mean":
        return 1.0
    if num_sequences < 1:
        raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
    if mode == "seq-mean-token-mean":
        return 0.0 if num_tokens_i == 0 else 1.0 / (num_sequences * num_tokens_i)
    if mode == "seq-mean-token-sum":
        return 1.0 / num_sequences
    if max_len is None or max_len < 1:
        raise ValueError(f"seq-mean-token-sum-norm needs max_len >= 1 (the constant L_max), got {max_len}")
    if num_tokens_i > max_len:
        raise ValueError(f"seq-mean-token-sum-norm: a trajectory with {num_tokens_i} action tokens > L_max = {max_len} "
                         "(L_max must bound every trajectory's action tokens: min(--max-turns × --max-new-tokens, "
                         "--seq-length) in a run)")
    return 1.0 / (num_sequences * max_len)


def barrier_divisor(mode: str, global_num_tokens: int) -> float:
    """Divide the accumulated gradient by this once, at the batch barrier, before clipping / the optimizer step.

    global_num_tokens: N_tok, action tokens of the whole batch across DP × CP (used only by token-mean).
    """
    _check_mode(mode)
    if mode == "token-mean":
        if global_num_tokens < 0:
            raise ValueError(f"global_num_tokens must be >= 0, got {global_num_tokens}")
        return float(max(global_num_tokens, 1))
    return 1.0


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str, *, global_num_tokens: int | None = None,
              num_sequences: int | None = None, max_len: int | None = None) -> torch.Tensor:
    """Reference batch aggregation, straight from the definitions (module table). Returns a scalar.

    per_token: (B, T); loss_mask: (B, T) (0/1 or bool). Defaults: global_num_tokens = Σ loss_mask,
    num_sequences = B, max_len = T.
    """
    _check_mode(mode)
    if per_token.shape != loss_mask.shape or per_token.dim() != 2:
        raise ValueError(f"per_token and loss_mask must both be (B, T); got {tuple(per_token.shape)}, "
                         f"{tuple(loss_mask.shape)}")
    mask = loss_mask.to(per_token.dtype)
    seq_sums = (per_token * mask).sum(dim=-1)  # (B,)
    if mode == "token-mean":
        n_tok = float(mask.sum()) if global_num_tokens is None else float(global_num_tokens)
        return seq_sums.sum() / max(n_tok, 1.0)
    b = per_token.shape[0] if num_sequences is None else num_sequences
    if mode == "seq-mean-token-mean":
        seq_means = seq_sums / mask.sum(dim=-1).clamp(min=1.0)  # (B,)
        return seq_means.sum() / b
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / b
    l_max = per_token.shape[-1] if max_len is None else max_len
    return seq_sums.sum() / (b * l_max)
