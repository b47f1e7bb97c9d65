"""Data preparation, a stage of its own: raw documents (JSONL or folders) in, a tokenized, sharded corpus with
its tokenizer and held-out pairs out, on this machine or on Ray Data."""
