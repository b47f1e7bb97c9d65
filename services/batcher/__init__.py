"""The batcher stage of the MARGE pipeline."""
