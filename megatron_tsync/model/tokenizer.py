"""Text <-> token ids: the one codec both the rollout side (agent loop, engines) and the learner side (SFT warm start,
evaluation) use, so a prompt is tokenised the same way wherever it is read.

Two ways to encode text. :meth:`TextCodec.encode` is for text the project itself writes (prompts, a format's markup:
``<result>``, ``<|im_start|>user\\n``): the tokenizer's special and added tokens (``</s>``, ``<|im_end|>``, Qwen's
``<think>`` / ``<tool_call>``) are matched and become their ids. :meth:`TextCodec.encode_text` is for text from
outside (tool output, a harness's messages): no special or added token is matched, so such text can never become a
special id, whatever it prints. An observation is a :class:`Rendered` string that knows which of its characters are
markup and which are data; :func:`encode_observation` encodes each part the right way (a plain ``str`` is all data).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable, Protocol, Sequence

__all__ = ["TextCodec", "TokenizerCodec", "Rendered", "encode_observation", "encode_parts", "tag_token_id"]


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _backend(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` of a ``tokenizers.Tokenizer`` or of a transformers fast tokenizer."""
    if hasattr(tokenizer, "pre_tokenizer") and hasattr(tokenizer, "model"):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no Hugging Face `tokenizers` backend: load a fast tokenizer "
                        f"(AutoTokenizer.from_pretrained(..., use_fast=True)) so tool output can be encoded without "
                        f"matching special tokens")
    return backend


@dataclasses.dataclass(frozen=True)
class TokenizerCodec:
    """A :class:`TextCodec` over a ``tokenizers.Tokenizer`` or a transformers fast tokenizer; special tokens are kept
    on decode (the tool parser needs ``<tool>``) and no BOS/EOS is added on encode."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids if hasattr(enc, "ids") else enc)

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: the tokenizer's normaliser, pre-tokeniser and model, without its added vocabulary
        (so no special or added token is matched). ``split_special_tokens=True`` / ``encode_special_tokens`` is not
        enough: it leaves added tokens that are not flagged special (Qwen3's ``<think>``, ``<tool_call>``,
        ``<tool_response>``) matched. Equal to :meth:`encode` on text that holds no added token."""
        # nothing to match: the tokenizer's own (fast) path gives the same ids
        ids = self._model_ids(text) if self._holds_added(text) else self.encode(text)
        bad = self.special_ids.intersection(ids)
        if bad:  # only a model whose own merges spell an added token could do this
            raise ValueError(f"the tokenizer's model encodes plain text to added-token ids {sorted(bad)}: "
                             f"it cannot keep tool output apart from special tokens")
        return ids

    def _holds_added(self, text: str) -> bool:
        """An added token's text in ``text`` or in its normalised form (where normalised added tokens match)."""
        norm = _backend(self.tokenizer).normalizer
        return self._added_re.search(text) is not None or (
            norm is not None and self._added_re.search(norm.normalize_str(text)) is not None)

    def _model_ids(self, text: str) -> list[int]:
        """Normaliser, pre-tokeniser and model: the added vocabulary never consulted."""
        tok = _backend(self.tokenizer)
        s = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
        pieces = tok.pre_tokenizer.pre_tokenize_str(s) if tok.pre_tokenizer is not None else [(s, None)]
        return [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of every added token (special or not): what :meth:`encode_text` never produces."""
        return frozenset(_backend(self.tokenizer).get_added_tokens_decoder())

    @functools.cached_property
    def _added_re(self) -> "re.Pattern":
        contents = sorted({t.content for t in _backend(self.tokenizer).get_added_tokens_decoder().values()}, key=len)
        return re.compile("|".join(re.escape(c) for c in reversed(contents) if c) or r"(?!)")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


class Rendered(str):
    """A ``str`` that also knows which of its characters are markup: ``parts`` is ``((text, is_markup), ...)``.

    A tool-call format's observation (``<result>`` + output + ``</result>``, Qwen's ``<|im_end|>\\n<|im_start|>user
    \\n<tool_response>\\n`` + output + ...) and a chat template's render are built as one, like markupsafe's
    ``Markup``: every reader sees the text, :func:`encode_observation` encodes the markup with special tokens and the
    data without. Operations on it (``+``, slicing) give a plain ``str``, which counts as data."""

    parts: tuple[tuple[str, bool], ...]

    def __new__(cls, parts: Iterable[tuple[str, bool]]):
        merged: list[list] = []
        for text, is_markup in parts:
            if not text:
                continue
            if merged and merged[-1][1] == bool(is_markup):
                merged[-1][0] += str(text)
            else:
                merged.append([str(text), bool(is_markup)])
        self = super().__new__(cls, "".join(t for t, _ in merged))
        self.parts = tuple((t, m) for t, m in merged)
        return self

    @classmethod
    def wrap(cls, open_markup: str, data: str, close_markup: str) -> "Rendered":
        return cls(((open_markup, True), (data, False), (close_markup, True)))

    def tail(self, start: int) -> "Rendered":
        """The characters from ``start`` on, parts kept."""
        out, pos = [], 0
        for text, is_markup in self.parts:
            end = pos + len(text)
            if end > start:
                out.append((text[max(0, start - pos):], is_markup))
            pos = end
        return Rendered(out)

    def __reduce__(self):
        return Rendered, (self.parts,)


def encode_parts(codec: TextCodec, text: str) -> list[tuple[list[int], bool]]:
    """``(ids, is_markup)`` per part of ``text`` (:class:`Rendered`; a plain ``str`` is one data part)."""
    parts = getattr(text, "parts", None)
    if parts is None:
        parts = ((str(text), False),)
    return [(codec.encode(t) if is_markup else codec.encode_text(t), is_markup) for t, is_markup in parts]


def encode_observation(codec: TextCodec, text: str) -> list[int]:
    """The ids of an observation: its markup parts with special tokens, everything else as plain text
    (:meth:`TextCodec.encode_text`), so text from a tool or a harness never becomes a special token id."""
    return [i for ids, _ in encode_parts(codec, text) for i in ids]


def tag_token_id(codec: TextCodec, tag: str) -> int:
    """The single token id of a special tag such as ``</tool>``; raises when the tokenizer splits it."""
    ids = codec.encode(tag)
    if len(ids) != 1:
        raise ValueError(f"{tag!r} is not a single token for this tokenizer: {ids}")
    return ids[0]
