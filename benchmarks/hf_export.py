"""``python benchmarks/hf_export.py GGUF OUT``: a float32 Hugging Face directory (config,
``model.safetensors``, tokenizer files) made from a GGUF by transformers' own GGUF loader, for
peers that read only Hugging Face directories (vLLM for CPU in ``benchmarks.served_peers`` and
``benchmarks/peers.py``).

It imports nothing of ours, so it runs under a peer's own Python (``/path/to/vllm-venv/bin/python
benchmarks/hf_export.py ...``): that environment needs ``torch``, ``transformers``, ``gguf`` and
``accelerate``. transformers dequantizes every block to float32 on load (its loader, not ours:
the weights are the peer's own reading of the file).
"""

from __future__ import annotations

import sys
from pathlib import Path


def export_hf_dir(gguf: Path, out: Path) -> Path:
    """Write ``out`` (made if missing) from ``gguf``, unless ``out/model.safetensors`` is already
    there; returns ``out``.

    transformers marks a GGUF-loaded model as quantized with method "gguf" and refuses to save it,
    although its tensors are plain float32 after the load: the marker is dropped before saving.

    Raises:
        ValueError, OSError: transformers cannot read the file (its message).
    """
    out = Path(out)
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module.__setattr__ types every attribute
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    model.save_pretrained(out)  # the weights last: their presence says the directory is whole
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/hf_export.py GGUF OUT")
    print(export_hf_dir(Path(sys.argv[1]), Path(sys.argv[2])))
