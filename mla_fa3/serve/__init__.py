"""Serving: continuous batching (scheduler), the serving loop, memory planning, serving metrics, the engine."""
