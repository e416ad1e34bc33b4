"""Data order, sampling and loading."""
