"""`ConfigError`, the error of a config value a user wrote, and `check_value`, the one-line
check that raises it. A leaf: it imports none of megaprm's packages, so every component config
(megaprm/config.py's root and the sub-configs beside their components, e.g.
rollout/config.py) and every package that refuses a setting can raise it without importing the
root config.
"""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value a user wrote that cannot work; the message says how to fix it."""


def check_value(cond: bool, path: str, value: Any, valid: str) -> None:
    """Raise ConfigError naming the dotted field `path`, its `value` and what would be `valid`
    unless `cond` holds."""
    if not cond:
        raise ConfigError(f"{path}={value!r} is not valid: {valid}")
