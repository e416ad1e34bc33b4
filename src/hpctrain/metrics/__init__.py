"""Metrics sinks, records and plots. Only global rank 0 writes; see MetricsLogger."""
