"""MARGE pre-training: the library every pipeline stage imports (model, tokenizer, corpus, config, protocol)."""

__version__ = "0.1.0"
