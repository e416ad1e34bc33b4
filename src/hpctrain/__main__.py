from hpctrain.cli import entry_point

entry_point()
