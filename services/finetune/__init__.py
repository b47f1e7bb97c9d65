"""Fine-tuning a pre-trained checkpoint on a task (`marge finetune`): a stage of its own, which meets the trainer only
through the library (the optimizer, `marge.model.optim`; the loopback hook, `marge.util.loopback`)."""
