"""The stages of the MARGE pipeline (indexer, batcher, trainer), the retrieval service and the driver that composes them; they import the library `marge` (shared/marge), never the other way round."""
