"""Distributed runtime: launch detection, the runtime value, collectives, model wrapping."""
