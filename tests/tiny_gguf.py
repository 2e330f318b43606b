"""Write a tiny random-weight Llama GGUF that the whole stack loads: config, tokenizer, weights.

For tests that need a real server without the 93 MB SmolLM2 download or its compile time::

    from service.engine.config import EngineConfig
    from tiny_gguf import write_tiny_llama_gguf  # tests/ is on sys.path under pytest
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    engine = EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32)
    srv = ServerThread(ServerConfig(model=str(path), port=0, metrics_port=0, engine=engine)).start()

The file has the ``llama.*`` keys ``LlamaConfig.from_gguf`` reads, the ``tokenizer.ggml.*`` keys
``Tokenizer.from_gguf`` needs (a byte-level BPE vocabulary: 3 control tokens, the 256 byte
symbols, a few merges; EOS ``<|im_end|>``) plus a ChatML template, and float32 tensors named as
``model.weights.gguf_weights`` expects, each stored [out, in] as numpy sees GGUF matrices.

The special tokens' embedding rows are zero, so with tied embeddings their logits are exactly 0
while the largest of the other ~260 random logits is positive: greedy decoding never emits EOS
and a request runs to ``max_tokens`` (sampling at temperature > 0 still can).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"))
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML that takes tools as Qwen2.5's template does (a system turn listing them, calls and
# results as <tool_call> / <tool_response> blocks), for the tool-call tests.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    '{% for c in m.tool_calls or [] %}\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS_ID = 2
# 3 specials + 256 bytes + 5 merges = 264 = 8 * 33: divisible by every TP size up to 8 and by 3.
VOCAB_SIZE = len(SPECIALS) + 256 + len(MERGES)


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level BPE vocabulary."""
    from model.text.tokenizer import bytes_to_unicode

    tokens = [*SPECIALS, *(bytes_to_unicode()[b] for b in range(256)), *(a + b for a, b in MERGES)]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


RANDOM_ONLY = ("q5_0", "q4_k", "q5_k", "q6_k")  # types written as random blocks


def random_rows(
    rng: np.random.Generator, fmt: str, n: int, k: int, wide: bool = False, spread: float = 0.0
) -> np.ndarray:
    """GGUF rows uint8 [n, k / unit * bytes] of ``fmt`` (one of ``RANDOM_ONLY``) with random
    bits, the float16 fields (d, dmin) random finite values: normal ones (|d| ~ 1e-3, or sized
    so the weights' spread is about ``spread``), or with ``wide`` any finite float16 bit pattern
    (subnormals, zeros, both signs, up to 65504)."""
    from model.weights.record_panels import RECORD_FORMATS, SOURCE_BYTES, SOURCE_HALVES

    code_spread = {"q5_0": 9.2, "q4_k": 4.6 * 18, "q5_k": 9.2 * 18, "q6_k": 18.5 * 74}[fmt]  # std of q (x sc)
    ku, size = k // RECORD_FORMATS[fmt].unit, SOURCE_BYTES[fmt]
    raw = rng.integers(0, 256, (n, ku, size), dtype=np.uint8)
    for at in SOURCE_HALVES[fmt]:
        if wide:
            bits = rng.integers(0, 1 << 16, (n, ku), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # no infinities or NaNs
            half = bits.view(np.float16)
        else:
            half = (rng.standard_normal((n, ku)) * (spread / code_spread if spread else 1e-3)).astype(np.float16)
        raw[..., at : at + 2] = half[..., None].view(np.uint8)
    return raw.reshape(n, ku * size)


def write_tiny_llama_gguf(
    path: str | Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    context_length: int = 512,
    seed: int = 0,
    quantize: str | dict[str, str] | None = None,
    chat_template: str = CHATML,
) -> Path:
    """Write the tiny model to ``path`` and return it (head dim = hidden_size // num_heads).

    ``quantize``: a ``gguf.GGMLQuantizationType`` name ("Q8_0", "Q4_0", "Q4_1") for every
    layer matmul tensor, or a mapping from tensor names, with or without the ``blk.{i}.``
    prefix ("blk.1.ffn_down.weight", "attn_q.weight", ...), to type names for some of them
    (``gguf.quants.quantize`` of the same random float32 values; for the types gguf cannot
    quantize to, Q5_0 and the K-quants, ``random_rows`` of the tensor's shape and about its
    spread); the rest stay float32. ``chat_template``: the file's (ChatML without tools by
    default; ``TOOLS_CHATML`` takes them)."""
    import gguf

    path = Path(path)
    tokens, types, merges = tiny_vocabulary()
    V, D, F, L, N, K = VOCAB_SIZE, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads
    H = D // N
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-random-llama")
    writer.add_vocab_size(V)
    writer.add_context_length(context_length)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_block_count(L)
    writer.add_head_count(N)
    writer.add_head_count_kv(K)
    writer.add_key_length(H)
    writer.add_value_length(H)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)
    matmuls = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"{m}.weight": quantize for m in matmuls} if isinstance(quantize, str) else dict(quantize or {})

    def add(name: str, array: np.ndarray) -> None:
        kind = types.get(name, types.get(name.split(".", 2)[-1] if name.startswith("blk.") else name))
        if kind is None:
            writer.add_tensor(name, array)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        if kind.lower() in RANDOM_ONLY:  # gguf cannot quantize to these: random blocks of the shape
            raw = random_rows(rng, kind.lower(), array.shape[0], array.shape[1], spread=float(array.std()))
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            return
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    def w(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    embed = w(V, D, scale=1.0)
    embed[: len(SPECIALS)] = 0.0  # special-token logits are exactly 0: greedy never picks EOS
    add("token_embd.weight", embed)
    for i in range(L):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", np.ones(D, np.float32))
        add(b + "attn_q.weight", w(N * H, D))
        add(b + "attn_k.weight", w(K * H, D))
        add(b + "attn_v.weight", w(K * H, D))
        add(b + "attn_output.weight", w(D, N * H))
        add(b + "ffn_norm.weight", np.ones(D, np.float32))
        add(b + "ffn_gate.weight", w(F, D))
        add(b + "ffn_up.weight", w(F, D))
        add(b + "ffn_down.weight", w(D, F))
    writer.add_tensor("output_norm.weight", np.ones(D, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
