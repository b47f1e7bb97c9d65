"""Measurement: retrieval and translation evaluation, the cost of index refreshes, stage metrics for the Ray
dashboard and TensorBoard. Imports the rooms below it."""
