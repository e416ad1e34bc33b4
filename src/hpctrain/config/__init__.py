"""Configuration: frozen schema, strict loading, batch arithmetic."""

from hpctrain.config.batch import BatchSizes, batch_sizes
from hpctrain.config.load import config_to_toml, load_config
from hpctrain.config.schema import RunConfig

__all__ = ["BatchSizes", "RunConfig", "config_to_toml", "load_config", "batch_sizes"]
