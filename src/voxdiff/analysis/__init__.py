"""Analysis, in one place: convergence (plateau, own best, critical batch) and statistics (tests, minimum
detectable differences). Pure numerics on loss curves and numbers: above the runtime, below everything that
trains, evaluates or reports (docs/development.md)."""
