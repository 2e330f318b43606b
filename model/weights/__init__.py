"""Weights in and out: reading GGUF files (``gguf_file``, ``gguf_weights``), Hugging Face
directories (``hf_weights``) and converted checkpoints (``checkpoint``) into the model's
parameters (``loader``), fetching the default model (``fetch``), and the forms weights take:
GGUF blocks kept as stored (``quant_panels``, ``block_params``) and float32 panels for the
native CPU kernel (``packed_weights``)."""
