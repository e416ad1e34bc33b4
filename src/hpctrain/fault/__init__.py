"""Fault tolerance: preemption signals and the stop vote, requeue, heartbeat and hang watchdog, alerts."""
