"""The training loop and its parts."""
