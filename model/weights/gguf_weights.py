"""Read a GGUF's tensors (a family of ``model.families`` whose GGUF files load: Llama, Qwen2,
Gemma 3) into the parameter tree of ``model.llama.Llama`` (host numpy).

Quantized tensors are dequantized with the ``gguf`` package's own ``gguf.quants.dequantize``.
GGUF stores each matrix as [out, in] (Hugging Face's ``nn.Linear`` order once numpy reverses
ggml's dimension order). A Llama file stores the rows of Q and K permuted for llama.cpp's
interleaved RoPE (``permute`` in llama.cpp's ``convert_hf_to_gguf.py``);
``unpermute_rope_rows`` undoes it so the rotate-half RoPE of ``model/llama.py`` applies, exactly
as Hugging Face does. A Qwen2 file keeps Hugging Face's order, and adds Q/K/V biases; a Gemma 3
file keeps it too, and adds q/k norms and the sandwich norms (post_attention_norm, post_ffw_norm;
its ffn_norm is the norm before the MLP, as in every family).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model.config import LlamaConfig
from model.families import FAMILIES
from model.llama import fuse_projections
from model.weights import quant_panels, record_panels
from model.weights.gguf_file import GGUFMetadataError, open_gguf


class WeightError(ValueError):
    """A tensor is missing from the file or has an unexpected shape."""


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    Args:
        w: [n_heads * H, D] float32 rows as stored in the GGUF (within each head the two RoPE
            halves are interleaved pairwise).
        n_heads: number of heads in ``w`` (query heads for Q, KV heads for K).

    Returns:
        [n_heads * H, D] with each head's rows in Hugging Face's half-split order.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _TensorTable:
    def __init__(self, reader: gguf.GGUFReader, progress: Callable[[str], None] | None = None):
        self._tensors = {t.name: t for t in reader.tensors}
        self._progress = progress

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise WeightError(f"GGUF tensor {name!r} is missing")
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(array.shape[-len(shape) :]) if array.ndim > len(shape) else array
        if tuple(array.shape) != shape:
            raise WeightError(f"GGUF tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
        if self._progress is not None:
            self._progress(name)
        return array


class _StoredBlocks:
    """The matmul weights of a GGUF as ``QuantPanels`` of their stored bytes, where every tensor
    a parameter is made of (in every layer) has a format kept as stored, or formats one of them
    holds exactly (``held_as``)."""

    def __init__(self, reader: gguf.GGUFReader, progress: Callable[[str], None] | None):
        self._tensors = {t.name: t for t in reader.tensors}
        self._progress = progress

    def format(self, names: list[str]) -> str | None:
        """The format all ``names`` are held in together (``held_as``), or None (a missing
        tensor, types no format holds together, or widths that are not whole blocks and
        32-column panels)."""
        tensors = [self._tensors.get(n) for n in names]
        present = [t for t in tensors if t is not None]
        formats = {quant_panels.format_of(t.tensor_type) for t in present}
        if len(present) < len(names) or None in formats:
            return None
        # ggml's shape is [inputs, rows]: both whole blocks / panels of 32
        if any(int(d) % quant_panels.BLOCK for t in present for d in t.shape[:2]):
            return None
        return held_as(formats)  # type: ignore[arg-type]

    def raw(self, name: str, rows: int, k: int) -> tuple[np.ndarray, str]:
        """Tensor ``name``'s bytes as [rows, bytes per row] uint8, checked, and its format.

        Raises:
            WeightError: the tensor is not [rows, K] or its bytes are not ``rows`` rows of K
                weights in its type.
        """
        t = self._tensors[name]
        fmt = quant_panels.format_of(t.tensor_type)
        assert fmt is not None  # format() chose this tensor's parameter
        if tuple(int(d) for d in t.shape[:2]) != (k, rows):  # ggml's order: [inputs, rows]
            raise WeightError(
                f"GGUF tensor {name!r} has shape {tuple(int(d) for d in t.shape)[::-1]}, expected {(rows, k)}"
            )
        data = np.asarray(t.data)
        if fmt in record_panels.RECORD_FORMATS:
            unit = record_panels.RECORD_FORMATS[fmt].unit
            want = (rows, k // unit * record_panels.SOURCE_BYTES[fmt])
        else:
            want = (rows, k // quant_panels.BLOCK * quant_panels.BLOCK_BYTES[fmt])
        if data.dtype != np.uint8 or data.size != want[0] * want[1]:
            raise WeightError(
                f"GGUF tensor {name!r} ({fmt}) holds {data.nbytes} bytes, expected {want[0] * want[1]} "
                f"for [{rows}, {k}] (truncated or corrupt)"
            )
        if self._progress is not None:
            self._progress(name)
        return data.reshape(want), fmt

    def panels(
        self, parts: list[tuple[str, int]], k: int, out_shape: tuple[int, ...], fmt: str, rows: np.ndarray | None = None
    ) -> quant_panels.QuantPanels:
        """``QuantPanels`` in format ``fmt`` of tensors ``parts`` ((name, rows) each)
        concatenated row-wise, output n being concatenated row ``rows[n]`` (None: in order).

        Raises:
            WeightError: a tensor's bytes do not match its shape (``raw``), or its blocks are
                unreadable.
        """
        stored = [self.raw(name, n, k) for name, n in parts]  # (bytes, format) each, checked
        try:
            if fmt in record_panels.RECORD_FORMATS:
                codes = [record_panels.convert(record_panels.decode(raw, src, k), fmt) for raw, src in stored]
                return quant_panels.pack_records(record_panels.concatenate(codes), out_shape, rows)
            raws = [raw if src == fmt else quant_panels.as_q8_0(raw, src, k) for raw, src in stored]
            return quant_panels.pack_rows(np.concatenate(raws), fmt, k, out_shape, rows)
        except ValueError as e:
            raise WeightError(f"GGUF tensors {[n for n, _ in parts]}: {e}") from e


def held_as(formats: set[str]) -> str | None:
    """The one stored format that holds tensors of all ``formats`` exactly, or None: a format
    alone is itself; Q4_0 and Q5_0 with Q8_0 are Q8_0 (their d (q - offset) is a Q8_0 value);
    the K-quants together as ``record_panels.union_format`` says (Q4_K_M files mix Q4_K and
    Q6_K in attn_v and ffn_down)."""
    if len(formats) == 1:
        return next(iter(formats))
    if formats <= {"q8_0", "q4_0", "q5_0"}:
        return "q8_0"
    if formats <= set(record_panels.RECORD_FORMATS):
        return record_panels.union_format(formats)
    return None


def stored_matmuls(source: str | Path | gguf.GGUFReader, cfg: LlamaConfig) -> dict[str, str]:
    """Which matmul parameters of a GGUF ``load_gguf_params(stored=True)`` keeps as stored
    blocks, and in which format: {"wqkv": "q4_1", "embed": "q8_0", ...}; the ones absent are
    dequantized (another type, or types no one format holds together: ``held_as``)."""
    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    blocks = _StoredBlocks(reader, None)
    out = {}
    for name, tensors in _matmul_tensors(cfg).items():
        fmt = blocks.format(tensors)
        if fmt is not None:
            out[name] = fmt
    return out


def _matmul_tensors(cfg: LlamaConfig) -> dict[str, list[str]]:
    per_layer = {
        "wqkv": ("attn_q", "attn_k", "attn_v"),
        "wo": ("attn_output",),
        "w_gate_up": ("ffn_gate", "ffn_up"),
        "w_down": ("ffn_down",),
    }
    out = {
        name: [f"blk.{i}.{t}.weight" for i in range(cfg.num_layers) for t in tensors]
        for name, tensors in per_layer.items()
    }
    out["embed"] = ["token_embd.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ["output.weight"]
    return out


def num_tensors(cfg: LlamaConfig) -> int:
    """How many tensors ``load_gguf_params`` reads for ``cfg`` (for a progress bar)."""
    per_layer = 9 + (3 if cfg.attention_bias else 0) + (2 if cfg.qk_norm else 0) + (2 if cfg.sandwich_norms else 0)
    return per_layer * cfg.num_layers + 2 + (0 if cfg.tie_word_embeddings else 1)


def load_gguf_params(
    source: str | Path | gguf.GGUFReader,
    cfg: LlamaConfig,
    dtype: Any = np.float32,
    progress: Callable[[str], None] | None = None,
    stored: bool = False,
) -> dict[str, Any]:
    """Every weight of a GGUF as the nested dict of ``Llama``'s state: dequantized, or,
    with ``stored``, the matmul weights whose tensors are Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K
    or Q6_K kept as their stored blocks (``model.weights.quant_panels.QuantPanels``; ``stored_matmuls`` says which).

    Args:
        source: a GGUF path or open reader.
        cfg: the config read from the same file (``LlamaConfig.from_gguf``).
        dtype: numpy dtype of the dequantized arrays (float32 by default; ml_dtypes.bfloat16 works).
        progress: called with each tensor's name after it is read (a progress bar's hook).
        stored: keep the matmul weights' blocks as stored where ``stored_matmuls`` allows:
            "wqkv", "w_gate_up" (fused, Q/K rows un-permuted by row index, never by value),
            "wo", "w_down" as stacked ``QuantPanels`` [L, ...]; "embed" (and "lm_head") as the
            table transposed, [D, V]. The values they hold are exactly the dequantized ones.

    Returns:
        ``{"embed": [V, D], "final_norm": [D], "layers": {"wqkv": [L, D, K, N/K + 2, H], ...},
        "lm_head": [D, V] (untied only)}``, numpy arrays laid out as ``model.llama`` expects
        (``model.llama.DecoderLayers``; Q/K/V and gate/up fused by ``fuse_projections``).

    Raises:
        WeightError: a tensor is missing or has the wrong shape.
        GGUFMetadataError: the file uses RoPE scaling, which this model does not implement.
    """
    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    table = _TensorTable(reader, progress)
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise GGUFMetadataError("GGUF has rope_freqs.weight (Llama-3 RoPE scaling), which is not supported")
    L, D, N, K, H, F, V = cfg.dims
    permuted = FAMILIES[cfg.architecture].gguf_rope_permuted

    def rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
        return unpermute_rope_rows(w, n_heads) if permuted else w

    keep = stored_matmuls(reader, cfg) if stored else {}
    blocks = _StoredBlocks(reader, progress)
    G = N // K

    # Filled in place, layer by layer (each layer fused on its own), so the peak is about one copy
    # of the float weights, not the three that stacking lists and fusing the stacks took.
    stacked: dict[str, np.ndarray] = {}
    quantized: dict[str, list[quant_panels.QuantPanels]] = {n: [] for n in keep if n not in ("embed", "lm_head")}
    # Output (k, c, h) of the fused QKV: query head k G + c (c < G), key head k (c = G), value
    # head k (c = G + 1), in the rows of [q; k; v] concatenated, Q and K rows un-permuted.
    q_rows = rope_rows(np.arange(N * H), N).reshape(K, G, H)
    k_rows = rope_rows(np.arange(K * H), K).reshape(K, 1, H)
    v_rows = np.arange(K * H).reshape(K, 1, H)
    qkv_rows = np.concatenate([q_rows, N * H + k_rows, N * H + K * H + v_rows], axis=1).reshape(-1)
    for i in range(L):
        b = f"blk.{i}."
        layer: dict[str, np.ndarray] = {}
        layer["attn_norm"] = table.get(b + "attn_norm.weight", (D,))
        layer["mlp_norm"] = table.get(b + "ffn_norm.weight", (D,))
        if "wqkv" in keep:
            parts = [(b + "attn_q.weight", N * H), (b + "attn_k.weight", K * H), (b + "attn_v.weight", K * H)]
            quantized["wqkv"].append(blocks.panels(parts, D, (K, G + 2, H), keep["wqkv"], qkv_rows))
        else:
            wq = rope_rows(table.get(b + "attn_q.weight", (N * H, D)), N)
            wk = rope_rows(table.get(b + "attn_k.weight", (K * H, D)), K)
            layer["wq"] = wq.T.reshape(D, N, H)
            layer["wk"] = wk.T.reshape(D, K, H)
            layer["wv"] = table.get(b + "attn_v.weight", (K * H, D)).T.reshape(D, K, H)
        if cfg.attention_bias:  # rows as the weights' rows (un-permuted with them)
            layer["bq"] = rope_rows(table.get(b + "attn_q.bias", (N * H,)), N).reshape(N, H)
            layer["bk"] = rope_rows(table.get(b + "attn_k.bias", (K * H,)), K).reshape(K, H)
            layer["bv"] = table.get(b + "attn_v.bias", (K * H,)).reshape(K, H)
        if cfg.qk_norm:
            layer["q_norm"] = table.get(b + "attn_q_norm.weight", (H,))
            layer["k_norm"] = table.get(b + "attn_k_norm.weight", (H,))
        if cfg.sandwich_norms:  # Gemma's, stored as the multipliers (convert_hf_to_gguf.py adds its 1)
            layer["post_attn_norm"] = table.get(b + "post_attention_norm.weight", (D,))
            layer["post_mlp_norm"] = table.get(b + "post_ffw_norm.weight", (D,))
        if "wo" in keep:
            quantized["wo"].append(blocks.panels([(b + "attn_output.weight", D)], N * H, (D,), keep["wo"]))
        else:
            layer["wo"] = table.get(b + "attn_output.weight", (D, N * H)).T.reshape(N, H, D)
        if "w_gate_up" in keep:
            parts = [(b + "ffn_gate.weight", F), (b + "ffn_up.weight", F)]
            quantized["w_gate_up"].append(blocks.panels(parts, D, (2, F), keep["w_gate_up"]))
        else:
            layer["w_gate"] = table.get(b + "ffn_gate.weight", (F, D)).T
            layer["w_up"] = table.get(b + "ffn_up.weight", (F, D)).T
        if "w_down" in keep:
            quantized["w_down"].append(blocks.panels([(b + "ffn_down.weight", D)], F, (D,), keep["w_down"]))
        else:
            layer["w_down"] = table.get(b + "ffn_down.weight", (D, F)).T
        for name, array in fuse_projections({n: a[None] for n, a in layer.items()}, K).items():
            if name not in stacked:
                stacked[name] = np.empty((L, *array.shape[1:]), dtype)
            stacked[name][i] = array[0]
        del layer

    fused: dict[str, Any] = dict(stacked)
    fused.update({n: quant_panels.stack(qs) for n, qs in quantized.items()})

    def table_of(name: str, key: str) -> Any:
        if key in keep:
            return blocks.panels([(name, V)], D, (V,), keep[key])
        t = table.get(name, (V, D))
        return (t if key == "embed" else t.T).astype(dtype)

    params: dict[str, Any] = {
        "embed": table_of("token_embd.weight", "embed"),
        "final_norm": table.get("output_norm.weight", (D,)).astype(dtype),
        "layers": fused,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = table_of("output.weight", "lm_head")
    return params
