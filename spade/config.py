"""One way to configure a service: the settings base class every service's settings derive from.

What it gives every service, so none writes its own:

- **Sources, in order of precedence**: explicit values (CLI flags, a composing caller), then a YAML or
  JSON file (``load(config_file=...)``, read by pydantic-settings' own ``YamlConfigSettingsSource``),
  then ``SPADE_<SERVICE>_*`` environment variables (``__`` nests: ``SPADE_ROLLOUT_QUEUE__URL``).
- **Unsafe defaults refused when the settings are built**: a service lists what is unsafe about its
  values in :meth:`ServiceSettings.unsafe_settings`; outside ``dev_mode`` building such settings
  raises, naming the variable and the fix. No caller has to remember to call a check.
- **Errors a person can act on**: :func:`describe_error` turns a ``ValidationError`` into one line
  per problem that names the environment variable, the rule and the value, for the CLI to print
  instead of a traceback.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Any, ClassVar, Self

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("spade_config_file", default=None)


def turned_off(variable: str) -> bool:
    """Whether the environment variable, a switch, turns something off (``0``, ``false``, ``no``, ``off``;
    unset: on)."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


class ConfigError(ValueError):
    """Settings could not be built; the message is meant for a person (no traceback needed)."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML/JSON settings file, refusing anything but a mapping.

    Raises:
        ConfigError: The file is missing, unreadable, not YAML, or not a mapping.
    """
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the settings file ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON ({exc})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    return loaded


class ServiceSettings(BaseSettings):
    """Base of every service's settings (see the module docstring).

    Subclasses set ``model_config = SettingsConfigDict(env_prefix="SPADE_<SERVICE>_")`` and override
    :meth:`unsafe_settings`.
    """

    # Partial update: SPADE_X_HTTP__HOST alone keeps the port of the field's default ``http`` section.
    model_config = SettingsConfigDict(
        env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True
    )

    service_name: ClassVar[str] = "service"
    """How errors name this service (``spade serve <service_name>``)."""

    dev_mode: bool = Field(
        default=False,
        description="Allow unsafe defaults (no keys, open binds, a degraded sandbox) for local development only.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _CONFIG_FILE.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings]
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        sources.extend([env_settings, dotenv_settings, file_secret_settings])
        return tuple(sources)

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Self:
        """Build the settings from ``overrides`` (``None`` values ignored), ``config_file`` and the environment.

        Raises:
            ConfigError: The file is not a readable mapping.
            ValidationError: A value breaks a rule (use :func:`describe_error` to print it).
        """
        if config_file is not None:
            read_config_file(config_file)  # a clear error before pydantic-settings reads it
        token = _CONFIG_FILE.set(config_file)
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            _CONFIG_FILE.reset(token)

    @classmethod
    def env_name(cls, *path: str | int) -> str:
        """The environment variable that sets the field at ``path``.

        >>> class Demo(ServiceSettings):
        ...     model_config = SettingsConfigDict(env_prefix="SPADE_DEMO_")
        >>> Demo.env_name("queue", "url")
        'SPADE_DEMO_QUEUE__URL'
        """
        prefix = str(cls.model_config.get("env_prefix") or "")
        delimiter = str(cls.model_config.get("env_nested_delimiter") or "__")
        return prefix + delimiter.join(str(p) for p in path).upper()

    def unsafe_settings(self) -> list[str]:
        """What is unsafe about these values outside dev mode: one sentence each, naming the variable and the fix.

        Called when the settings are built; an empty list means safe.
        """
        return []

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Self:
        if self.dev_mode:
            return self
        problems = self.unsafe_settings()
        if problems:
            raise ValueError(
                "unsafe settings outside dev mode: "
                + "; ".join(problems)
                + f" (or set {type(self).env_name('dev_mode')}=true for local development only)"
            )
        return self


def describe_error(exc: ValidationError | ConfigError, settings_cls: type[ServiceSettings] | None = None) -> str:
    """One line per problem in ``exc``, each naming the environment variable, the rule and the value.

    Values of fields whose name suggests a secret are never echoed.
    """
    if isinstance(exc, ConfigError):
        return str(exc)
    lines = []
    for error in exc.errors(include_url=False):
        loc = [part for part in error.get("loc", ()) if not isinstance(part, int) or part >= 0]
        where = settings_cls.env_name(*loc) if settings_cls is not None and loc else ".".join(map(str, loc))
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        value = error.get("input")
        secret = any(word in where.lower() for word in ("key", "token", "password", "secret"))
        shown = "" if secret or isinstance(value, dict) or not loc else f" (got {value!r})"
        lines.append(f"{where or 'settings'}: {message}{shown}")
    return "\n".join(lines)
