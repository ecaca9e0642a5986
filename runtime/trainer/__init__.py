"""DSpark trainer: draft model and loss, FSDP2, LR schedules, checkpoints, metrics."""
