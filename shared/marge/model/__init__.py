"""The networks and what saves and loads them: MARGE (architecture, layers, network, losses, sizes), VECO,
generation, the relevance encoder's embeddings, checkpoints, snapshots and fine-tuned folders.
Imports `marge.contracts` and `marge.util`."""
