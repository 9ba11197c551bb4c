"""Replica registry: what schedulers publish (identity, load, cached blocks) and the in-memory index."""
