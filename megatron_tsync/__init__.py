"""megatron_tsync: exact streaming-gradient RL post-training on Megatron-Core."""
__version__ = "0.1.0"
