"""Node monitors started with each node's launcher, and the report built from their logs."""
