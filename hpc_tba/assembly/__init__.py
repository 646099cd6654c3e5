"""The assembly layer: composing the run, setting up ranks, building roles and engines."""
