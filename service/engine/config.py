"""The engine's settings (``EngineConfig``): sizes, dtypes and kernel modes of one engine.

Plain Python, no JAX: the command line's parser and the config-file reader import it.
"""

from __future__ import annotations

import dataclasses

# How a model's weights are held (``EngineConfig.weights``; the --weights choices of serve,
# layouts and roofline).
WEIGHT_MODES = ("auto", "stored", "int8", "float32", "bfloat16")
DTYPES = ("float32", "bfloat16")  # parameter and KV-cache dtypes
KV_DTYPES = (*DTYPES, "int8")  # the KV cache's: also 8-bit codes with a scale per row
ATTENTION_MODES = ("auto", "xla")
MATMUL_MODES = ("auto", "xla")
LAYER_LOOPS = ("auto", "scan", "unrolled")
SPECULATIVE_MODES = ("off", "ngram", "draft:MODEL")  # EngineConfig.speculative's forms
DRAFT_PREFIX = "draft:"
# Tokens a replica's decode region may fill with speculating sequences' tokens (each its newest id
# and its drafts), at least: 8 held one stream's k = 4 drafts for 0.47x the plain TPOT, while a
# batch of 4 each verifying 4 drafts (20 tokens) ran at 0.86x the plain tokens/s on 2 cores
# (docs/speculative.md, "When a sequence speculates").
MIN_VERIFY_TOKENS = 8


def verify_tokens(k: int) -> int:
    """The sampling positions a data replica's decode region fills with decode tokens and draft ids
    when sequences propose up to ``k`` drafts: 1 + k, and at least ``MIN_VERIFY_TOKENS``; drafts
    are proposed only while a step's samplers leave room below it."""
    return max(MIN_VERIFY_TOKENS, 1 + k)


def resolve_kv_dtype(kv_dtype: str, dtype: str) -> str:
    """``EngineConfig.kv_dtype`` resolved: "auto" becomes the parameter ``dtype``."""
    return dtype if kv_dtype == "auto" else kv_dtype


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes, dtypes and kernel modes of one engine.

    Attributes:
        num_slots: rows, the most sequences running at once (vLLM's ``max_num_seqs``).
        max_seq_len: the most tokens (prompt + generated) one sequence may hold.
        chunk_size: most prompt tokens of one sequence per step.
        dtype: parameter dtype name, "float32" (the default, everywhere) or "bfloat16".
        kv_dtype: KV-cache dtype name: "auto" (the parameters' ``dtype``), "float32" or
            "bfloat16" or "int8". A bfloat16 cache with float32 weights halves the bytes each
            decode step's attention reads (vLLM's ``--kv-cache-dtype`` is the same choice); keys
            and values are rounded to nearest even once, when written, and attention reads them
            widened exactly to float32. "int8" holds each (token, KV head) row as 8-bit codes
            and a float16 scale (``model.attention.pages.to_stored``): H + 2 bytes a row, against
            2 H in bfloat16.
        attention: "auto" (the native CPU kernels where they apply: one CPU device, G <= 8,
            head_dim a multiple of 16, the kernels built; else XLA's) or "xla".
        matmul: "auto" (float32 weights packed into panels for the native CPU kernel where it
            applies: one CPU device, outputs in whole 32-column panels, the kernel built) or
            "xla" (XLA's dots).
        layer_loop: how the step runs the decoder blocks: "scan" (stacked weights, one block
            compiled), "unrolled" (per-layer weights, L blocks compiled) or "auto": scan on
            CPU, unrolled on accelerators (``model.kernels``).
        weights: how a GGUF's matmul weights are held: "stored" (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K tensors
            kept in their 32-weight blocks, ``model.weights.quant_panels``, multiplied by
            float32 activations at exactly their dequantized values: the native CPU kernel on
            one CPU device, XLA's dequantize-then-dot elsewhere; the norms and any tensor of
            another type dequantized to ``dtype``), "float32" or "bfloat16" (every weight
            dequantized to that dtype; it sets ``dtype``), "int8" (the float matmul weights
            quantized at load to Q8_0 blocks, symmetric int8 with a float16 scale per 32
            inputs, and multiplied as stored blocks are; blocks already stored kept), or
            "auto": "stored" where the model holds blocks and every pool is one CPU device with
            the kernel built (``model.kernels.keeps_blocks``), else ``dtype``. A Hugging Face
            directory or float checkpoint holds float weights: "stored" keeps them as they are.
        page_size: token positions per page of the KV cache (a power of two).
        kv_cache_tokens: positions in the pool (0: from ``kv_cache_memory``, or by default from
            the devices' memory: ``service.engine.kv_pool``); ``max_seq_len`` stays each
            request's limit. A ``Runner``'s ``ecfg`` holds the resolved size.
        kv_cache_memory: bytes of the pool per device (0: not given); at most one of it and
            ``kv_cache_tokens``.
        max_num_batched_tokens: most prefill tokens one step runs, over the chunks of several
            prompts (each padded to whole blocks of the step's prefill region); decode tokens
            have a region of their own, one position per row. 1024 by default: a burst of
            prompts is prefilled in half the steps of 512, each step's fixed cost paid half as
            often (docs/performance.md, "The served path against vLLM for CPU"); one prompt
            still takes ``chunk_size`` tokens a step.
        speculative: "off"; "ngram": decoding sequences propose draft ids by n-gram prompt
            lookup (``service.engine.ngram``); or "draft:MODEL": a draft model (a name, GGUF file
            or directory as ``--model`` takes) proposes them greedily
            (``service.engine.draft_model``). Each step verifies them (docs/speculative.md).
        speculative_tokens: most draft ids one sequence proposes per step (k), >= 1; drafts fill
            a data replica's decode region up to ``verify_tokens(k)`` sampled positions.
        ngram_max, ngram_min: the longest and shortest suffix the n-gram proposer matches.
        draft_p_min: a draft model stops a sequence's drafting after a draft it gives less
            than this probability (llama.cpp's ``--draft-p-min``, default 0.75 as there); 0:
            always ``speculative_tokens`` drafts. In [0, 1).
    """

    num_slots: int = 4
    max_seq_len: int = 2048
    chunk_size: int = 512
    dtype: str = "float32"
    kv_dtype: str = "auto"
    attention: str = "auto"
    matmul: str = "auto"
    layer_loop: str = "auto"
    weights: str = "auto"
    page_size: int = 16
    kv_cache_tokens: int = 0
    kv_cache_memory: int = 0
    max_num_batched_tokens: int = 1024
    speculative: str = "off"
    speculative_tokens: int = 7
    ngram_max: int = 3
    ngram_min: int = 2
    draft_p_min: float = 0.75

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        if self.weights in DTYPES:  # --weights bfloat16 is --dtype bfloat16
            object.__setattr__(self, "dtype", self.weights)
        for name, choices in (("dtype", DTYPES), ("attention", ATTENTION_MODES), ("matmul", MATMUL_MODES),
                              ("layer_loop", LAYER_LOOPS)):  # fmt: skip
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be 'auto' or one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0 (0: from the devices' memory), got {self.kv_cache_tokens}")
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory must be >= 0 bytes (0: not given), got {self.kv_cache_memory}")
        if self.kv_cache_tokens and self.kv_cache_memory:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.speculative not in ("off", "ngram") and not self.draft_model:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if self.speculative_tokens < 1:
            raise ValueError(f"speculative_tokens must be >= 1, got {self.speculative_tokens}")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1), got {self.draft_p_min}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")

    @property
    def draft_model(self) -> str | None:
        """The draft model of ``speculative`` "draft:MODEL" (None for another mode)."""
        if self.speculative.startswith(DRAFT_PREFIX) and self.speculative[len(DRAFT_PREFIX) :].strip():
            return self.speculative[len(DRAFT_PREFIX) :].strip()
        return None

    @property
    def verify_tokens(self) -> int:
        """The decode tokens and draft ids of one replica's step while sequences speculate
        (``verify_tokens``), or 0: no speculation."""
        return verify_tokens(self.speculative_tokens) if self.speculative != "off" else 0

    @property
    def num_pages(self) -> int:
        """Pages in the pool: ``kv_cache_tokens`` over ``page_size``, rounded up; before a
        ``Runner`` resolves a size that was not given in tokens (``service.engine.kv_pool``),
        num_slots x max_seq_len positions'."""
        tokens = self.kv_cache_tokens or self.num_slots * self.max_seq_len
        return -(-tokens // self.page_size)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + generated) one request may hold: ``max_seq_len``, and no
        more than the whole pool, so a request that could never fit is refused at admission
        instead of waiting forever."""
        return min(self.max_seq_len, self.num_pages * self.page_size)
