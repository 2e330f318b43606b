"""Text in and out: the tokenizer and chat template read from the model (``tokenizer``), and the
incremental, UTF-8-safe detokenizer of a stream of ids (``detokenizer``)."""
