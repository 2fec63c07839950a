"""Text <-> token ids: the one codec both the rollout side (agent loop, engines) and the learner side (SFT warm start,
evaluation) use, so a prompt is tokenised the same way wherever it is read."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class TokenizerCodec:
    """A :class:`TextCodec` over a ``tokenizers.Tokenizer`` or a transformers tokenizer; special tokens are kept
    on decode (the tool parser needs ``<tool>``) and no BOS/EOS is added on encode."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids if hasattr(enc, "ids") else enc)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def tag_token_id(codec: TextCodec, tag: str) -> int:
    """The single token id of a special tag such as ``</tool>``; raises when the tokenizer splits it."""
    ids = codec.encode(tag)
    if len(ids) != 1:
        raise ValueError(f"{tag!r} is not a single token for this tokenizer: {ids}")
    return ids[0]
