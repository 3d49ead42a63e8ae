"""Typed cluster configuration: schema, loading (YAML/JSON), embedded default."""
from motor.config.schema import (  # noqa: F401
    ClusterConfig, ControllerConfig, CoordinatorConfig, EngineConfig, NodeConfig,
    RetryConfig, TimeoutConfig, DeploymentMode, EngineKind, PolicyName, Role, RestartPolicy,
)
from motor.config.load import load_config, load_default_config, parse_config  # noqa: F401
from motor.errors import ConfigError  # noqa: F401
