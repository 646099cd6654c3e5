"""Replay buffer: per-prompt storage, samplers, sharding, durability."""
