"""`voxdiff advise`: what train.accumulate_every (and the micro-batch, and the GPU count) costs or saves on
the user's own model at the user's own point in training, in samples, steps and minutes.

Four measurements from one checkpoint, then a table (`command.run_advise` runs them in this order):

- measure.speed_sweep: peak memory and samples/s of training steps at micro-batch 1, 2, 4, ... on the device
  training would use, until an out-of-memory (caught), the memory limit, or samples/s stops growing;
- measure.noise_scale: the gradient noise scale B_simple at the checkpoint's weights with the single-sample
  probe (marginal over timesteps and per timestep bucket, each with a confidence interval);
- measure.run_branches: short training branches from the checkpoint at effective batch b, 2b, 4b, 8b on the
  same samples, two seeds or more (the largest batch first: its gain sets the target, or, when it lowers
  nothing, the next batch down's; the smaller ones stop once past it), their EMA validated at its weights' mean sample position; fit.fit_branches reads the steps
  each needed to the target and fits S = S_min (1 + B_crit / B): a local B_crit with an interval that needs
  no noise-scale theory (the study found B_simple >10x off under L1 with clipping);
- fit.candidates / fit.recommend: micro-batch x accumulate_every x world size, with memory, samples/s, samples
  and steps to the same progress relative to the best, and predicted minutes; report.py writes Markdown,
  JSON and a figure and logs them to MLflow as their own run.

Pure arithmetic lives in fit.py (numpy only), so it is tested without torch.
"""
