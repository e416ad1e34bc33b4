"""Readers of data sets in the layout their authors publish, turned into shard samples by `hpctrain shard`."""
