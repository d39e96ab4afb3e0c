"""What every layer shares: errors, artifacts and their manifests, locks, model store, backend facts, metrics."""
