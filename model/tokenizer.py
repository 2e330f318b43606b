"""Text <-> token ids for a GGUF model, built from the vocabulary stored in the GGUF file.

A GGUF file has no ``tokenizer.json``; it stores the vocabulary (``tokenizer.ggml.tokens``), the BPE
merges, the token types and the special token ids as metadata. :class:`Tokenizer` rebuilds a
``tokenizers.Tokenizer`` from them the way Hugging Face transformers does when it loads a GGUF
(``transformers/integrations/gguf`` + ``convert_slow_tokenizer``), except for the pre-tokenizer, which
follows llama.cpp (``llm_tokenizer_bpe`` in ``src/llama-vocab.cpp``) so text is split as the model
was trained:

* model: byte-level BPE (``tokenizers.models.BPE``) over the file's vocabulary and merges; a token
  not already spelled in the GPT-2 byte alphabet is re-spelled into it;
* pre-tokenizer, by ``tokenizer.ggml.pre``:

  - ``default``/``gpt2``: ``ByteLevel(add_prefix_space=False, use_regex=True)`` (the GPT-2 split
    regex);
  - ``smollm``: every digit (``\\p{N}``) split off on its own first, then the GPT-2 regex, i.e.
    ``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)])``,
    the pre-tokenizer of the original SmolLM2 ``tokenizer.json`` and llama.cpp's
    ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` (regexes ``\\p{N}`` then the GPT-2 regex). transformers ignores
    the name and uses the plain GPT-2 regex, so its ids differ on some text with digits: ``"x  1"``
    is ``[x, ĠĠ, 1]`` here and in llama.cpp but ``[x, Ġ, Ġ, 1]`` in transformers;
  - ``llama3``/``llama-v3``/``llama-bpe``: the llama-3 split regex, then byte-level mapping;

* decoder: ``ByteLevel``; no normalizer, no post-processor;
* control tokens (``token_type == 3``, e.g. ``<|im_start|>``) are special added tokens, matched
  whole in the text and dropped by ``decode(..., skip_special_tokens=True)``; user-defined tokens
  (``token_type == 4``) are plain added tokens.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from model.gguf_file import field_value, open_gguf

if TYPE_CHECKING:
    from model.detokenizer import IncrementalDetokenizer

_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ``tokenizer.ggml.pre`` -> how text is split before the byte-level mapping: "gpt2" (the GPT-2 regex),
# "digits+gpt2" (each digit on its own, then the GPT-2 regex) or a split regex.
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens (256 entries)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` name.

    Raises:
        ValueError: the name is not one this module knows how to split.
    """
    key = pre or "default"
    if key not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(_PRE_TOKENIZER_SPLITS)}"
        )
    split = _PRE_TOKENIZER_SPLITS[key]
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits+gpt2":
        # Digits uses Rust's char::is_numeric, i.e. \p{N}, as llama.cpp's first SMOLLM regex does.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own ``tojson`` HTML-escapes; chat templates expect plain JSON (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox, with the helpers transformers provides to templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A byte-level BPE tokenizer read from a GGUF file, plus its chat template.

    Build it with :meth:`from_gguf`. Token ids are Python ``int`` in ``[0, vocab_size)``.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        tokens: list[str],
        token_types: list[int],
        bos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        template_tokens: dict[str, str],
    ) -> None:
        self._backend = backend
        self._tokens = tokens
        self._bos_id = bos_id
        self._eos_ids = eos_ids
        self._add_bos = add_bos
        self._special_ids = frozenset(i for i, t in enumerate(token_types) if t == _CONTROL)
        self._chat_template = chat_template
        self._template_tokens = template_tokens

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Args:
            path_or_reader: a GGUF file path, or a reader from :func:`model.gguf_file.open_gguf`.

        Raises:
            FileNotFoundError: the path does not exist.
            model.gguf_file.GGUFMetadataError (a ValueError): a required key is missing.
            ValueError: ``tokenizer.ggml.model`` is not ``"gpt2"``, ``tokenizer.ggml.pre`` is unknown, or
                ``tokenizer.ggml.token_type`` and ``tokenizer.ggml.tokens`` differ in length.
        """
        reader = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else open_gguf(path_or_reader)
        kind = field_value(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer tokenizer.ggml.model={kind!r}; only 'gpt2' (byte-level BPE) is supported"
            )
        tokens = [str(t) for t in field_value(reader, "tokenizer.ggml.tokens")]
        token_types = [int(t) for t in field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]

        spelling = bytes_to_unicode()
        alphabet = frozenset(spelling.values())
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if not set(token) <= alphabet:
                token = "".join(spelling[b] for b in token.encode("utf-8"))
            vocab.setdefault(token, index)
        backend = HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        )
        backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", None))
        backend.decoder = decoders.ByteLevel()
        # A control token spelled outside the byte alphabet is a mislabel; transformers skips those too.
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, kind_ in zip(tokens, token_types, strict=True)
            if kind_ == _CONTROL and set(t) <= alphabet
        ]
        backend.add_special_tokens(control)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, token_types, strict=True)
            if kind_ == _USER_DEFINED and t in vocab
        ]
        if user:
            backend.add_tokens(user)

        def token_id(key: str) -> int | None:
            value = field_value(reader, f"tokenizer.ggml.{key}", None)
            return None if value is None else int(value)

        bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
        eos_ids = frozenset(i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None)
        names = {"bos_token": bos_id, "eos_token": eos_id, "unk_token": token_id("unknown_token_id")}
        names["pad_token"] = token_id("padding_token_id")
        template_tokens = {name: tokens[i] for name, i in names.items() if i is not None}
        return cls(
            backend=backend,
            tokens=tokens,
            token_types=token_types,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=field_value(reader, "tokenizer.chat_template", None),
            template_tokens=template_tokens,
        )

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def bos_id(self) -> int | None:
        """``tokenizer.ggml.bos_token_id`` (None if the file has none)."""
        return self._bos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: ``eos_token_id`` plus ``eot_token_id``/``eom_token_id`` if present."""
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of control tokens (``token_type == 3``); they decode to no text."""
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the GGUF vocabulary (49152 for SmolLM2)."""
        return len(self._tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control-token strings in it become their single ids.

        A BOS id is prepended only when the file sets ``tokenizer.ggml.add_bos_token``.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        return ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD.

        Raises:
            OverflowError/TypeError: an id is negative or not an int (from ``tokenizers``).
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the GGUF chat template.

        The template runs in a jinja2 sandbox with ``trim_blocks``/``lstrip_blocks``, the
        ``raise_exception``/``strftime_now`` helpers, a non-escaping ``tojson`` filter, and the
        variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token`` (those the file defines), ``tools``/``documents`` (None) and ``kwargs``.

        Raises:
            ValueError: the file has no ``tokenizer.chat_template``.
            jinja2.TemplateError: the template raised (e.g. via ``raise_exception``) or is malformed.
        """
        if not self._chat_template:
            raise ValueError("this GGUF file has no tokenizer.chat_template; cannot render chat messages")
        template = _compile_template(self._chat_template)
        variables = {"tools": None, "documents": None, **self._template_tokens, **kwargs}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer (see :mod:`model.detokenizer`) for one generated sequence."""
        from model.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self)
