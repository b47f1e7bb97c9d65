"""The indexer stage of the MARGE pipeline."""
