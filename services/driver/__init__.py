"""The driver that starts and watches every stage of a run."""
