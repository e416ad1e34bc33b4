"""Experiment trackers (Weights & Biases, MLflow) as sinks of the MetricsLogger: rank 0 only, in a thread of their
own, one tracker run per training (its id in RUN_DIR/trackers/), records sent once a checkpoint holds their step so
a resume never has to take any back (sink.py says how)."""
