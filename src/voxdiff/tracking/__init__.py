"""MLflow: where runs live (uri) and one run per training (runs)."""
