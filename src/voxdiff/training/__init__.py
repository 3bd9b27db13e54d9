"""Training: budget/LR/EMA schedules, the exact-accumulation trainer, checkpoints, DDP runtime, noise scale, the stage."""
