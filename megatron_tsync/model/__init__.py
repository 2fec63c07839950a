"""What both sides of the wire need of the network, below ``training/`` and ``rollout/`` (neither imports the other).

- ``builder``: ``ModelArch`` (a Hugging Face config read into one record), ``PrecisionConfig``, ``build_model`` (a
  megatron-core ``GPTModel``: local layer spec on CPU, Transformer Engine spec with FP8 on GPU);
- ``hf_conversion``: Hugging Face ⇄ Megatron state dicts for every TP/PP layout, HF folders in and out;
- ``compat/``: every megatron-core version difference and the CPU shims, in one place (``cpu``, ``versions``,
  ``attention``: torch-SDPA core attention of the local spec; all re-exported by ``compat``);
- ``logprobs``: vocab-parallel log-probs / entropy of a model's logits;
- ``moe``: Qwen3-MoE through megatron-core's MoE layer (config mapping, expert conversion, router replay);
- ``incremental``: the KV-kept incremental forward (turn-level OPD, the teacher's scorer);
- ``parallel``: process groups from torchrun / SLURM (``ParallelDims``);
- ``wrappers``: ``unwrap`` (the ``GPTModel`` inside DDP / Float16Module; re-exported by ``builder``);
- ``tokenizer``: the text ⇄ token-id codec;
- ``tiny_model``: a tiny random model with a locally trained tokenizer (quickstart, tests).
"""
