"""Read a Llama GGUF's tensors into the parameter tree of ``model.llama.Llama`` (host numpy).

Quantized tensors are dequantized with the ``gguf`` package's own ``gguf.quants.dequantize``.
GGUF stores each matrix as [out, in] (Hugging Face's ``nn.Linear`` order once numpy reverses
ggml's dimension order), and stores the rows of Q and K permuted for llama.cpp's interleaved
RoPE (``permute`` in llama.cpp's ``convert_hf_to_gguf.py``); ``unpermute_rope_rows`` undoes it
so the rotate-half RoPE of ``model/llama.py`` applies, exactly as Hugging Face does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model.config import LlamaConfig
from model.gguf_file import GGUFMetadataError, open_gguf
from model.llama import fuse_projections


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


def num_tensors(cfg: LlamaConfig) -> int:
    """How many tensors ``load_gguf_params`` reads for ``cfg`` (for a progress bar)."""
    return 9 * cfg.num_layers + 2 + (0 if cfg.tie_word_embeddings else 1)


def load_gguf_params(
    source: str | Path | gguf.GGUFReader,
    cfg: LlamaConfig,
    dtype: Any = np.float32,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Dequantize every weight of a Llama GGUF into the nested dict of ``Llama``'s state.

    Args:
        source: a GGUF path or open reader.
        cfg: the config read from the same file (``LlamaConfig.from_gguf``).
        dtype: numpy dtype of the returned arrays (float32 by default; ml_dtypes.bfloat16 works).
        progress: called with each tensor's name after it is read (a progress bar's hook).

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

    names = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
    layers: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i in range(L):
        b = f"blk.{i}."
        wq = unpermute_rope_rows(table.get(b + "attn_q.weight", (N * H, D)), N)
        wk = unpermute_rope_rows(table.get(b + "attn_k.weight", (K * H, D)), K)
        layers["attn_norm"].append(table.get(b + "attn_norm.weight", (D,)))
        layers["wq"].append(wq.T.reshape(D, N, H))
        layers["wk"].append(wk.T.reshape(D, K, H))
        layers["wv"].append(table.get(b + "attn_v.weight", (K * H, D)).T.reshape(D, K, H))
        layers["wo"].append(table.get(b + "attn_output.weight", (D, N * H)).T.reshape(N, H, D))
        layers["mlp_norm"].append(table.get(b + "ffn_norm.weight", (D,)))
        layers["w_gate"].append(table.get(b + "ffn_gate.weight", (F, D)).T)
        layers["w_up"].append(table.get(b + "ffn_up.weight", (F, D)).T)
        layers["w_down"].append(table.get(b + "ffn_down.weight", (D, F)).T)

    params: dict[str, Any] = {
        "embed": table.get("token_embd.weight", (V, D)).astype(dtype),
        "final_norm": table.get("output_norm.weight", (D,)).astype(dtype),
        "layers": fuse_projections({n: np.stack(arrs).astype(dtype) for n, arrs in layers.items()}, K),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = table.get("output.weight", (V, D)).T.astype(dtype)
    return params
