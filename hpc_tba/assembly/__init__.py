"""The assembly layer: composes the run's configuration and builds the system from components."""
