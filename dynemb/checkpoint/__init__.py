"""Checkpoints of dynamic tables."""
