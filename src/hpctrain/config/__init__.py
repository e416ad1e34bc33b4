"""Configuration: frozen schema, strict loading, batch arithmetic."""

from hpctrain.config.batch import BatchPlan, plan_batches
from hpctrain.config.load import config_to_toml, load_config
from hpctrain.config.schema import RunConfig

__all__ = ["BatchPlan", "RunConfig", "config_to_toml", "load_config", "plan_batches"]
