"""gemmd's configuration: gemmd.yaml loaded into frozen dataclasses (``schema``), validated
with every problem named by its key and line (``checks``), and the exporter's web
configuration file (``web``). Both files are read by the hardened reader (gemmd.files).
Imports nothing of gemmd above the vocabulary and that reader.
"""

from gemmd.config.checks import MIN_WINDOW_S, budget_warnings, check, load, parse, warnings
from gemmd.config.schema import (
    BACKENDS,
    DEFAULT_EXPLORATION,
    DEFAULT_SENTINELS,
    BudgetConfig,
    Config,
    DriftConfig,
    ExplorationConfig,
    FakeConfig,
    FakeDeviceConfig,
    ListenConfig,
    MeasureConfig,
    MetricsConfig,
    ModelConfig,
    ProbeGroup,
    ProbesConfig,
    ScheduleConfig,
    StoreConfig,
)
from gemmd.config.web import TLSSettings, WebConfig, load_web_config

__all__ = ["BACKENDS", "DEFAULT_EXPLORATION", "DEFAULT_SENTINELS", "MIN_WINDOW_S",
           "BudgetConfig", "Config", "DriftConfig", "ExplorationConfig", "FakeConfig",
           "FakeDeviceConfig", "ListenConfig", "MeasureConfig", "MetricsConfig", "ModelConfig",
           "ProbeGroup", "ProbesConfig", "ScheduleConfig", "StoreConfig", "TLSSettings",
           "WebConfig", "budget_warnings", "check", "load", "load_web_config", "parse",
           "warnings"]
