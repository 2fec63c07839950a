"""The wrappers megatron puts around a ``GPTModel`` (DDP, Float16Module) and the one way to see through them.

Its own module so that ``builder`` (which builds MoE layers through ``moe``) and ``moe`` (whose router replay walks
the model's layers) both reach it without importing each other. ``builder`` re-exports :func:`unwrap`.
"""

from __future__ import annotations

__all__ = ["unwrap"]


def unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
