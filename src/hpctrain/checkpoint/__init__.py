"""Checkpoints: storage and format (atomic, verified) apart from policy (when, how many)."""
