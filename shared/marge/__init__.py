"""MARGE pre-training: the library every pipeline stage imports (model, tokenizer, corpus, config, protocol)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`marge.load(path)`: a pre-training checkpoint or a fine-tuned folder, ready to use (`marge.model.finetuned.load`).
    Imported on first use, so that `import marge.contracts.batch` and the other contracts need no torch."""
    if name == "load":
        from marge.model.finetuned import load

        return load
    raise AttributeError(f"module 'marge' has no attribute {name!r}")
