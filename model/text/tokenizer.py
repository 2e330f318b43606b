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
  - ``qwen2``: the llama-3 regex with one digit per piece (``\\p{N}`` for ``\\p{N}{1,3}``), as
    llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_QWEN2`` and Qwen2's ``tokenizer.json``;

* decoder: ``ByteLevel``; no normalizer, no post-processor;
* control tokens (``token_type == 3``, e.g. ``<|im_start|>``) are special added tokens, matched
  whole in the text and dropped by ``decode(..., skip_special_tokens=True)``; user-defined tokens
  (``token_type == 4``) are plain added tokens.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported.

A Hugging Face model directory already has a ``tokenizer.json``; :meth:`Tokenizer.from_hf_dir` loads
it as saved and reads the special tokens and chat template from ``tokenizer_config.json``. A converted
checkpoint (``model/weights/checkpoint.py``) carries a ``tokenizer.json`` and ``meshserve_tokenizer.json``
written by :meth:`Tokenizer.save`, whatever the source was (:meth:`Tokenizer.from_checkpoint`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from model.weights.gguf_file import field_value, open_gguf

_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# ``tokenizer.ggml.pre`` -> how text is split before the byte-level mapping: "gpt2" (the GPT-2 regex),
# "digits+gpt2" (each digit on its own, then the GPT-2 regex) or a split regex.
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
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


@cache
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of :func:`bytes_to_unicode`: a byte-level token's character -> its byte."""
    return {ch: b for b, ch in bytes_to_unicode().items()}


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


TOKENIZER_META_FILE = "meshserve_tokenizer.json"


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents, or {} when the file does not exist.

    Raises:
        ValueError: the file is not valid JSON or not an object.
    """
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """A token id field (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_chat_template(root: Path, tc: dict[str, Any]) -> str | None:
    """The default chat template: ``tokenizer_config.json``'s ``chat_template`` (a string, or a
    list of named templates of which "default" is taken), else ``chat_template.jinja``."""
    template = tc.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja = root / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


class Tokenizer:
    """A tokenizer plus its chat template and special ids.

    Build it with :meth:`from_gguf` (a byte-level BPE rebuilt from GGUF metadata),
    :meth:`from_hf_dir` (a Hugging Face model directory's ``tokenizer.json``) or
    :meth:`from_checkpoint` (what :meth:`save` wrote beside a converted checkpoint). Token ids are
    Python ``int`` in ``[0, vocab_size)``.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        vocab_size: int,
        special_ids: frozenset[int],
        bos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        template_tokens: dict[str, str],
    ) -> None:
        self._backend = backend
        self._vocab_size = vocab_size
        self._bos_id = bos_id
        self._eos_ids = eos_ids
        self._add_bos = add_bos
        self._special_ids = special_ids
        self._chat_template = chat_template
        self._template_tokens = template_tokens
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' cache (a dict: thread-safe enough, idempotent)

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Args:
            path_or_reader: a GGUF file path, or a reader from :func:`model.weights.gguf_file.open_gguf`.

        Raises:
            FileNotFoundError: the path does not exist.
            model.weights.gguf_file.GGUFMetadataError (a ValueError): a required key is missing.
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
            vocab_size=len(tokens),
            special_ids=frozenset(i for i, t in enumerate(token_types) if t == _CONTROL),
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=field_value(reader, "tokenizer.chat_template", None),
            template_tokens=template_tokens,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``: its normalizer,
        pre-tokenizer, model, decoder and added tokens as saved), and from
        ``tokenizer_config.json`` the BOS/EOS/UNK/PAD token strings, ``add_bos_token`` and the chat
        template (or from ``chat_template.jinja``, where transformers 5 saves it). EOS ids are the
        EOS token plus every ``eos_token_id`` of ``generation_config.json`` and ``config.json``
        (Llama 3 Instruct ends turns with ``<|eot_id|>``, listed only there). Special ids are the
        added tokens marked ``special``. Without ``add_bos_token``, BOS is prepended when the
        ``tokenizer.json`` post-processor adds it.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` (slow-only tokenizers are not supported).
            ValueError: a JSON file is malformed, or a named special token is not in the vocabulary.
        """
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found (a Hugging Face fast tokenizer's tokenizer.json is required)")
        backend = HFTokenizer.from_file(str(file))
        tc = _read_json_object(root / "tokenizer_config.json")
        gen = _read_json_object(root / "generation_config.json")
        model_cfg = _read_json_object(root / "config.json")

        def token_id(name: str) -> int | None:
            text = _token_text(tc.get(name))
            if text is None:
                return None
            i = backend.token_to_id(text)
            if i is None:
                raise ValueError(f"{root / 'tokenizer_config.json'}: {name} {text!r} is not in the vocabulary")
            return int(i)

        bos_id = token_id("bos_token")
        if bos_id is None:
            bos_id = next(iter(_ids(gen.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id"))), None)
        eos_ids = set(_ids(gen.get("eos_token_id"))) | set(_ids(model_cfg.get("eos_token_id")))
        eos_id = token_id("eos_token")
        if eos_id is not None:
            eos_ids.add(eos_id)
        template_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(tc.get(name))
            if text is not None:
                template_tokens[name] = text
        for name, fallback in (("bos_token", bos_id), ("eos_token", min(eos_ids, default=None))):
            spelled = backend.id_to_token(fallback) if fallback is not None else None
            if name not in template_tokens and spelled is not None:
                template_tokens[name] = spelled

        add_bos = tc.get("add_bos_token")
        if add_bos is None:
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        special = frozenset(int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special)
        return cls(
            backend=backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            special_ids=special,
            bos_id=bos_id,
            eos_ids=frozenset(eos_ids),
            add_bos=bool(add_bos),
            chat_template=_hf_chat_template(root, tc),
            template_tokens=template_tokens,
        )

    def save(self, out_dir: str | Path) -> None:
        """Write this tokenizer into ``out_dir`` as ``tokenizer.json`` (the ``tokenizers`` backend)
        and ``meshserve_tokenizer.json`` (vocabulary size, special/BOS/EOS ids, ``add_bos``, chat
        template and template token strings); :meth:`from_checkpoint` reads them back."""
        out = Path(out_dir)
        self._backend.save(str(out / "tokenizer.json"))
        meta = {
            "format_version": 1,
            "vocab_size": self._vocab_size,
            "special_ids": sorted(self._special_ids),
            "bos_id": self._bos_id,
            "eos_ids": sorted(self._eos_ids),
            "add_bos": self._add_bos,
            "chat_template": self._chat_template,
            "template_tokens": self._template_tokens,
        }
        (out / TOKENIZER_META_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer:
        """The tokenizer :meth:`save` wrote into a converted checkpoint directory.

        Raises:
            FileNotFoundError: ``tokenizer.json`` or ``meshserve_tokenizer.json`` is missing.
            ValueError: ``meshserve_tokenizer.json`` is malformed.
        """
        root = Path(path)
        for name in ("tokenizer.json", TOKENIZER_META_FILE):
            if not (root / name).is_file():
                raise FileNotFoundError(f"{root / name} not found: the checkpoint's tokenizer is incomplete")
        meta = _read_json_object(root / TOKENIZER_META_FILE)
        try:
            return cls(
                backend=HFTokenizer.from_file(str(root / "tokenizer.json")),
                vocab_size=int(meta["vocab_size"]),
                special_ids=frozenset(int(i) for i in meta["special_ids"]),
                bos_id=None if meta["bos_id"] is None else int(meta["bos_id"]),
                eos_ids=frozenset(int(i) for i in meta["eos_ids"]),
                add_bos=bool(meta["add_bos"]),
                chat_template=meta["chat_template"],
                template_tokens={str(k): str(v) for k, v in meta["template_tokens"].items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{root / TOKENIZER_META_FILE} is malformed: {exc!r}") from exc

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def bos_id(self) -> int | None:
        """The BOS id (``tokenizer.ggml.bos_token_id`` for a GGUF; None if the model has none)."""
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
        """Number of token ids (the GGUF vocabulary, 49152 for SmolLM2; for ``tokenizer.json``,
        its vocabulary plus added tokens)."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control-token strings in it become their single ids.

        A BOS id is prepended only when the file sets ``tokenizer.ggml.add_bos_token``.
        """
        # encode_batch lets go of the GIL where encode holds it (tokenizers' bindings): a long
        # text tokenized on a worker thread leaves the other threads running.
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self._add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        return ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD.

        Raises:
            OverflowError/TypeError: an id is negative or not an int (from ``tokenizers``).
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (control tokens' own text included), at
        least 1. It walks the whole vocabulary (``token_bytes`` of every id), so it is computed
        once, on first use, and cached (its time: docs/performance.md, "Tokenizing on the
        host")."""
        return max(1, *(len(self.token_bytes(t)) for t in range(self._vocab_size)))

    def tokens_at_least(self, text_bytes: int) -> int:
        """A lower bound on the tokens of any text of ``text_bytes`` UTF-8 bytes, without
        tokenizing it: each token stands for at most ``max_token_bytes`` of the text. A
        vocabulary with a normalizer (NFC, for one, composes up to 3 bytes into 1) gets a
        quarter of that, so the bound never exceeds the true count."""
        shrink = 1 if self._backend.normalizer is None else 4
        return text_bytes // (shrink * self.max_token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's logprobs report them (``bytes``).

        In a byte-level BPE vocabulary (a ``ByteLevel`` decoder: GGUF models, Llama 3 and SmolLM2
        ``tokenizer.json`` files) a token is spelled in GPT-2's byte alphabet and maps back to its
        bytes, which may be part of a multi-byte character (so they need not be valid UTF-8);
        a control token gives its own text (``<|im_end|>``). In other vocabularies, the UTF-8
        of the token's decoded text. Cached per id.

        Raises:
            ValueError: ``token_id`` is outside ``[0, vocab_size)``.
        """
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside [0, {self._vocab_size})")
        spelled = self._backend.id_to_token(token_id) or ""
        if isinstance(self._backend.decoder, decoders.ByteLevel):
            table = _unicode_to_bytes()
            byte_spelled = all(ch in table for ch in spelled)  # else an added token written as plain text
            out = bytes(table[ch] for ch in spelled) if byte_spelled else spelled.encode("utf-8")
        else:
            out = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._token_bytes[token_id] = out
        return out

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's chat template.

        The template runs in a jinja2 sandbox with ``trim_blocks``/``lstrip_blocks``, the
        ``raise_exception``/``strftime_now`` helpers, a non-escaping ``tojson`` filter, and the
        variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token`` (those the file defines), ``tools``/``documents`` (None) and ``kwargs``.

        Raises:
            ValueError: the model has no chat template.
            jinja2.TemplateError: the template raised (e.g. via ``raise_exception``) or is malformed.
        """
        if not self._chat_template:
            raise ValueError("this model has no chat template (tokenizer.chat_template); cannot render chat messages")
        template = _compile_template(self._chat_template)
        variables = {"tools": None, "documents": None, **self._template_tokens, **kwargs}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
