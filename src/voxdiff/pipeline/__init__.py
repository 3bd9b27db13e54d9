"""The top floor's stages: train and evaluate as DVC runs them (stages/*.py -> voxdiff.entry), and the plan
`voxdiff train --plan` prints. They orchestrate the floors below (docs/development.md)."""
