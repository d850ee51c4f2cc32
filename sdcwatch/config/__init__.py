"""The configuration of ``sdcwatch serve``: one small dataclass per section (schema), loaded in layers
(loaders: defaults < TOML file < environment < flags), its flags and their help generated
from the field docstrings (docs).
"""

from sdcwatch.config.docs import add_serve_arguments, config_from_args, overrides_from_args
from sdcwatch.config.loaders import ENV_PREFIX, env_name, flag_name, load_config
from sdcwatch.config.schema import (
    SECURITY_KEYS,
    AlertsConfig,
    BusConfig,
    DetectorsConfig,
    GuardPolicyConfig,
    MetricsConfig,
    ServeConfig,
    StateConfig,
)

__all__ = [
    "BusConfig",
    "MetricsConfig",
    "AlertsConfig",
    "StateConfig",
    "DetectorsConfig",
    "GuardPolicyConfig",
    "ServeConfig",
    "SECURITY_KEYS",
    "ENV_PREFIX",
    "load_config",
    "add_serve_arguments",
    "overrides_from_args",
    "config_from_args",
    "env_name",
    "flag_name",
]
