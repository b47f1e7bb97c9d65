"""What the stages agree on, written once: the batch and its Redis queue protocol, the corpus and its tokenizer,
the index versions, artifacts (atomic folders with a checksummed manifest), the train log, the config helpers and
the task files. Imports only `marge.util`; needs no torch."""
