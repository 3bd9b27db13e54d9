"""The diffusion model: network and schedulers (model), training objective and its draws (objective), samplers (sampling)."""
