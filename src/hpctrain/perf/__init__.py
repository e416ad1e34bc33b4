"""Performance pre-flight: bandwidth, matrix-multiply throughput, stragglers."""
