"""Training: budget/LR/EMA schedules, the exact-accumulation trainer, the best point, checkpoints, post-hoc EMA, noise scale."""
