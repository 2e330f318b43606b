"""Text <-> token ids for a GGUF model, built from the vocabulary stored in the GGUF file.

A GGUF file has no ``tokenizer.json``; it stores the vocabulary (``tokenizer.ggml.tokens``), the BPE
merges, the token types and the special token ids as metadata. :class:`Tokenizer` rebuilds a
``tokenizers.Tokenizer`` from them the way Hugging Face transformers does when it loads a GGUF
(``transformers/integrations/gguf``), by ``tokenizer.ggml.model``:

``gpt2`` (byte-level BPE: SmolLM2, Qwen2.5, Llama 3), except for the pre-tokenizer, which follows
llama.cpp (``llm_tokenizer_bpe`` in ``src/llama-vocab.cpp``) so text is split as the model was
trained:

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
  (``token_type == 4``) are plain added tokens;
* BOS is prepended only when the file sets ``tokenizer.ggml.add_bos_token``.

``llama`` (SentencePiece BPE) with ``general.architecture`` ``gemma``/``gemma2``/``gemma3``: the
Gemma vocabulary, token for token what transformers' ``GemmaTokenizer`` does with the file:

* model: BPE over the file's tokens with byte fallback (a character not in the vocabulary becomes
  its UTF-8 bytes, the tokens ``<0x00>``..``<0xFF>``) and ``<unk>`` for anything else. A token of
  only spaces (stored as ``"  "``) is re-spelled ``"▁▁"``. The file has no merges; they are rebuilt
  from the vocabulary: every split of a token into two tokens, ranked by the token's position in the
  file (earlier first; Gemma's scores do not follow its merge order), then by longer left part;
* normalizer: every space becomes ``▁`` (U+2581); no prefix space (``add_space_prefix`` is false in
  Gemma files and not applied), no pre-tokenizer: each stretch of text between added tokens is one
  BPE word;
* decoder: ``▁`` back to a space, byte tokens back to bytes, fused; an invalid byte sequence is one
  U+FFFD (transformers gives one per byte token; :meth:`Tokenizer.decode` says why);
* control tokens (``<bos>``, ``<start_of_turn>``, ``<end_of_turn>``, ``<unusedN>`` ...) are special
  added tokens; user-defined tokens (``\\n``, runs of ``\\n`` and ``\\t``, ``<b>``, ``<table>`` ...)
  are plain added tokens, matched whole in the text;
* BOS is prepended unless the file sets ``tokenizer.ggml.add_bos_token`` false (llama.cpp's default
  for SentencePiece); EOS ids also hold ``<end_of_turn>``, which llama.cpp treats as end of
  generation by its text.

Any other ``tokenizer.ggml.model`` (or ``llama`` for another architecture) is a ValueError.

A Hugging Face model directory already has a ``tokenizer.json``; :meth:`Tokenizer.from_hf_dir` loads
it as saved and reads the special tokens and chat template from ``tokenizer_config.json``. A converted
checkpoint (``model/weights/checkpoint.py``) carries a ``tokenizer.json`` and ``meshserve_tokenizer.json``
written by :meth:`Tokenizer.save`, whatever the source was (:meth:`Tokenizer.from_checkpoint`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from model.weights.gguf_file import field_value, open_gguf

_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_USER_DEFINED = 4

# ``general.architecture`` values whose ``tokenizer.ggml.model == "llama"`` vocabulary is Gemma's
# SentencePiece BPE (transformers builds all three with one builder, ``gemma_tokenizer``).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_SPACE_MARK = "\u2581"  # "▁": SentencePiece's spelling of a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token: "<0xE4>" is the byte 0xE4
# Token texts llama.cpp ends generation on whatever the metadata says (``special_eog_ids`` in
# ``src/llama-vocab.cpp``, matched by text); of its list, the one a Gemma vocabulary has.
_GEMMA_EOG_TEXTS = frozenset({"<end_of_turn>"})
_REPLACEMENT = "\ufffd"


def _sentencepiece_decoder() -> decoders.Decoder:
    """Gemma's decoder: ``▁`` back to a space, byte tokens ``<0xAB>`` back to bytes, all fused.

    Each token's text is its own, whatever its neighbours (no prefix space is stripped), so the
    text of a run of ids is their :meth:`Tokenizer.token_bytes` joined, decoded as UTF-8.
    """
    return decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])


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


def _byte_level_backend(tokens: list[str], token_types: list[int], merges: list[Any]) -> HFTokenizer:
    """The byte-level BPE of a ``tokenizer.ggml.model == "gpt2"`` vocabulary, without its
    pre-tokenizer (:func:`_pre_tokenizer` gives that).

    Args:
        tokens: ``tokenizer.ggml.tokens``.
        token_types: ``tokenizer.ggml.token_type``, as long as ``tokens``.
        merges: ``tokenizer.ggml.merges`` ("left right" strings).
    """
    spelling = bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel; transformers skips those too.
    _add_file_tokens(backend, tokens, token_types, vocab, control_ok=lambda t: set(t) <= alphabet)
    return backend


def _add_file_tokens(
    backend: HFTokenizer,
    tokens: list[str],
    token_types: list[int],
    vocab: dict[str, int],
    control_ok: Callable[[str], bool] = lambda t: True,
) -> None:
    """Add a GGUF vocabulary's control tokens (those ``control_ok`` accepts) to ``backend`` as
    special added tokens, matched whole and dropped by ``decode(skip_special_tokens=True)``, and
    its user-defined tokens spelled as in ``vocab`` as plain added tokens, matched whole."""
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _CONTROL and control_ok(t)
        ]
    )
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)


def _sentencepiece_merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary without stored merges implies, best first.

    Every split of a token into two tokens of ``vocab`` is a merge. They rank by the token's
    position in ``tokens`` (a spelling listed twice counts where ``vocab`` puts it, its last
    position), then by the longer left part: the order transformers' ``gemma_tokenizer`` gives
    (``generate_merges`` with the negated position as the score). That order comes out of one walk,
    with no sort: about 1 s for Gemma 3's 262,144 tokens (515k merges).
    """
    merges: list[tuple[str, str]] = []
    for index, token in enumerate(tokens):
        if vocab[token] != index:
            continue
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _gemma_backend(tokens: list[str], token_types: list[int], unk_token: str) -> HFTokenizer:
    """Gemma's SentencePiece BPE (``tokenizer.ggml.model == "llama"`` in a gemma/gemma2/gemma3
    file), as the module docstring describes.

    Args:
        tokens: ``tokenizer.ggml.tokens``.
        token_types: ``tokenizer.ggml.token_type``, as long as ``tokens``.
        unk_token: the text of ``tokenizer.ggml.unknown_token_id`` (``<unk>``).
    """
    # The normalizer turns spaces into "▁", so a token stored as real spaces would never match.
    # (transformers re-spells any whitespace-only token with a space in it; Gemma's are all spaces.)
    spelled = [_SPACE_MARK * len(t) if t and t.strip(" ") == "" else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}  # a repeated spelling: the last id
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_sentencepiece_merges(spelled, vocab),
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    backend.decoder = _sentencepiece_decoder()
    # A user-defined token of only spaces is in the vocabulary as "▁..." (and reached through the
    # merges), not as its stored spelling, so it is not added; the reference skips it the same way.
    _add_file_tokens(backend, tokens, token_types, vocab)
    return backend


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


class NoChatTemplateError(ValueError):
    """Chat messages for a model without a chat template (a base model): only plain prompts."""


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

    Build it with :meth:`from_gguf` (a byte-level or Gemma SentencePiece BPE rebuilt from GGUF metadata),
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
        # Gemma's decoder (also read back by from_checkpoint): its text is the tokens' bytes joined.
        decoder = backend.decoder
        self._bytes_decode = (
            getattr(backend.model, "byte_fallback", False)
            and decoder is not None
            and decoder.__getstate__() == _sentencepiece_decoder().__getstate__()
        )

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        ``tokenizer.ggml.model`` picks the vocabulary (the module docstring says what each builds):
        ``"gpt2"`` a byte-level BPE, ``"llama"`` with ``general.architecture`` gemma, gemma2 or
        gemma3 Gemma's SentencePiece BPE with byte fallback.

        Args:
            path_or_reader: a GGUF file path, or a reader from :func:`model.weights.gguf_file.open_gguf`.

        Raises:
            FileNotFoundError: the path does not exist.
            model.weights.gguf_file.GGUFMetadataError (a ValueError): a required key is missing.
            ValueError: ``tokenizer.ggml.model`` is neither ``"gpt2"`` nor ``"llama"`` of a Gemma
                architecture, ``tokenizer.ggml.pre`` is unknown (for ``"gpt2"``), or
                ``tokenizer.ggml.token_type`` and ``tokenizer.ggml.tokens`` differ in length.
        """
        reader = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else open_gguf(path_or_reader)
        kind = field_value(reader, "tokenizer.ggml.model")
        architecture = field_value(reader, "general.architecture", None)
        gemma = kind == "llama" and architecture in _GEMMA_ARCHITECTURES
        if kind != "gpt2" and not gemma:
            raise ValueError(
                f"unsupported GGUF tokenizer tokenizer.ggml.model={kind!r} (general.architecture={architecture!r}); "
                f"supported: 'gpt2' (byte-level BPE), and 'llama' (SentencePiece BPE) for architectures "
                f"{', '.join(_GEMMA_ARCHITECTURES)}"
            )
        tokens = [str(t) for t in field_value(reader, "tokenizer.ggml.tokens")]
        token_types = [int(t) for t in field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
        if len(token_types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokenizer.ggml.tokens"
            )

        def token_id(key: str) -> int | None:
            value = field_value(reader, f"tokenizer.ggml.{key}", None)
            return None if value is None else int(value)

        bos_id, eos_id, unk_id = token_id("bos_token_id"), token_id("eos_token_id"), token_id("unknown_token_id")
        eos_ids = {i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        if gemma:
            unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else "<unk>"
            backend = _gemma_backend(tokens, token_types, unk)
            eos_ids.update(i for i, t in enumerate(tokens) if t in _GEMMA_EOG_TEXTS)
        else:
            backend = _byte_level_backend(tokens, token_types, field_value(reader, "tokenizer.ggml.merges"))
            backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", None))
        names = {"bos_token": bos_id, "eos_token": eos_id, "unk_token": unk_id}
        names["pad_token"] = token_id("padding_token_id")
        template_tokens = {name: tokens[i] for name, i in names.items() if i is not None}
        return cls(
            backend=backend,
            vocab_size=len(tokens),
            special_ids=frozenset(i for i, t in enumerate(token_types) if t == _CONTROL),
            bos_id=bos_id,
            eos_ids=frozenset(eos_ids),
            # llama.cpp and transformers add BOS to a SentencePiece vocabulary whose file does not say.
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", gemma)),
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
        """Ids that end generation: ``eos_token_id`` plus ``eot_token_id``/``eom_token_id`` if present
        (and, in a Gemma vocabulary, ``<end_of_turn>``, as llama.cpp does)."""
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

    def vocabulary_difference(self, other: Tokenizer) -> str | None:
        """Why ``other`` does not map the same ids to the same tokens as this tokenizer (the
        number of ids, or the first id whose token differs), or None when they agree: the check a
        draft model's tokenizer must pass against its target's (its drafts are target ids)."""
        if self.vocab_size != other.vocab_size:
            return f"{other.vocab_size} token ids, not {self.vocab_size}"
        mine, theirs = self._backend.get_vocab(with_added_tokens=True), other.backend.get_vocab(with_added_tokens=True)
        if mine != theirs:
            by_id, other_by_id = {i: t for t, i in mine.items()}, {i: t for t, i in theirs.items()}
            first = min(i for i in by_id.keys() | other_by_id.keys() if by_id.get(i) != other_by_id.get(i))
            return f"id {first} is {other_by_id.get(first)!r}, not {by_id.get(first)!r}"
        return None

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

    def encode_chat(self, rendered: str) -> list[int]:
        """Token ids of a prompt ``apply_chat_template`` rendered: as :meth:`encode`, but a
        template that writes the BOS itself (``{{ bos_token }}``: Gemma's, Llama's) gets no second
        one prepended, as llama.cpp strips it from the rendered text (``common_chat_templates_apply``)
        and transformers adds none to a rendered chat."""
        ids = self.encode(rendered)
        if self._add_bos and self._bos_id is not None and ids[:2] == [self._bos_id, self._bos_id]:
            del ids[0]  # the one encode prepended; the template's own stays
        return ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD.

        In a GGUF vocabulary each maximal invalid byte sequence gives one U+FFFD: what the
        ``ByteLevel`` decoder does, and what :class:`model.text.detokenizer.IncrementalDetokenizer`
        relies on to hold an incomplete character (its first bytes must not decode the same apart
        as together). Gemma's ``ByteFallback`` decoder gives one U+FFFD per byte token of an
        invalid run instead (``<0xF0><0x9D>`` is two; ``<0xF0><0x41>`` is two, not U+FFFD then ``A``),
        as transformers' decode does; so with that decoder the text of ids whose decode has a
        U+FFFD is recomputed from their :meth:`token_bytes` (``bytes.decode("utf-8", "replace")``).
        Valid text decodes the same either way.

        Raises:
            OverflowError/TypeError: an id is negative or not an int (from ``tokenizers``).
        """
        ids = list(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._bytes_decode and _REPLACEMENT in text:
            dropped = self._special_ids if skip_special_tokens else frozenset()
            raw = b"".join(self.token_bytes(i) for i in ids if i not in dropped and 0 <= i < self._vocab_size)
            text = raw.decode("utf-8", errors="replace")
        return text

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
        vocabulary with a normalizer gets a quarter of that, so the bound never exceeds the true
        count: NFC, for one, composes up to 3 bytes into 1, and Gemma's turns spaces into ``▁``,
        so a ``▁`` (3 bytes) written in the text itself lands in a token whose ``token_bytes``
        count it as the 1 byte of a space."""
        shrink = 1 if self._backend.normalizer is None else 4
        return text_bytes // (shrink * self.max_token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's logprobs report them (``bytes``).

        In a byte-level BPE vocabulary (a ``ByteLevel`` decoder: GGUF models, Llama 3 and SmolLM2
        ``tokenizer.json`` files) a token is spelled in GPT-2's byte alphabet and maps back to its
        bytes, which may be part of a multi-byte character (so they need not be valid UTF-8);
        a control token gives its own text (``<|im_end|>``). In a BPE with byte fallback (Gemma)
        a byte token ``<0xE4>`` is that one byte (also part of a character). In other
        vocabularies, and for the other tokens of a byte-fallback one, the UTF-8 of the token's
        decoded text (Gemma: ``▁`` is a space; a control token its own text). Cached per id.

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
        elif getattr(self._backend.model, "byte_fallback", False) and (piece := _BYTE_PIECE.fullmatch(spelled)):
            out = bytes([int(piece[1], 16)])
        else:
            out = self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._token_bytes[token_id] = out
        return out

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source (None: the model has none)."""
        return self._chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's chat template.

        The template runs in a jinja2 sandbox with ``trim_blocks``/``lstrip_blocks``, the
        ``raise_exception``/``strftime_now`` helpers, a non-escaping ``tojson`` filter, and the
        variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token`` (those the file defines), ``tools``/``documents`` (None) and ``kwargs``.

        Raises:
            NoChatTemplateError (a ValueError): the model has no chat template (a base model's
                file, such as gemma-3-270m's).
            jinja2.TemplateError: the template raised (e.g. via ``raise_exception``) or is malformed.
        """
        if not self._chat_template:
            raise NoChatTemplateError(
                "this model has no chat template (tokenizer.chat_template); cannot render chat messages"
            )
        template = _compile_template(self._chat_template)
        variables = {"tools": None, "documents": None, **self._template_tokens, **kwargs}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
