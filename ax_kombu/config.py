"""One typed settings object for every ax process, its fields grouped by whom they serve.

:class:`Settings` is one flat, frozen record (``settings.claim_batch``), made of four
sections (:mod:`ax_kombu.config_sections`): :class:`CommonSettings` (every process: the
store, the broker, heartbeats), :class:`ProducerSettings` (``enqueue``),
:class:`SchedulerSettings` and :class:`WorkerSettings`; each section checks its own
fields. (The console, ``ax web``, has no setting of its own: its flags are its command's.)

Precedence, lowest first: the sections' defaults < ``AX_*`` environment variables
< ``ax.configure(...)`` / CLI flags. Every field ``name`` is read from the
variable ``AX_NAME`` (for example ``database_url`` from ``AX_DATABASE_URL``). A renamed
setting is still read by its old name (:data:`RENAMED`), with a warning in the log.

With nothing set, ax is embedded and server-free: the store is a SQLite file
and the broker is ax's own SQLite Kombu transport, both in the current
directory, so two terminals in the same folder share them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ax_kombu.config_sections import (
    CommonSettings,
    ProducerSettings,
    SchedulerSettings,
    WorkerSettings,
)
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.observability.redaction import redact_url

__all__ = ["PRIORITIES", "RENAMED", "CommonSettings", "ProducerSettings", "SchedulerSettings",
           "Settings", "WorkerSettings", "from_env", "parse_duration_ms", "redact_url",
           "worker_queue"]

log = logging.getLogger(__name__)

PRIORITIES = ("high", "default", "slow")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, None: 1000}


def parse_duration_ms(text: str) -> int:
    """Parse ``"250ms"``, ``"5s"``, ``"2m"``, ``"1.5h"`` or a bare number of seconds.

    Raises:
        ConfigurationError: the text is not a non-negative duration.
    """
    match = _DURATION.match(text)
    if not match:
        raise ConfigurationError(f"not a duration: {text!r} (use e.g. 500ms, 5s, 2m, 1h)")
    return round(float(match.group(1)) * _UNIT_MS[match.group(2)])


def worker_queue(node_id: str) -> str:
    """The queue a worker consumes besides the priority queues: what is sent to it alone
    (a shard of ``shards="workers"``)."""
    return f"ax.worker.{node_id}"


@dataclass(frozen=True, kw_only=True)
class Settings(WorkerSettings, SchedulerSettings, ProducerSettings, CommonSettings):
    """Everything an ax process can be told: the four sections' fields, flat. See the
    module docstring for precedence."""

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied and validated (a renamed setting's old name
        is taken for its new one, with a warning).

        Raises:
            ConfigurationError: an unknown setting, or one that cannot work.
        """
        changes = _renamed(changes, "setting")
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigurationError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        settings = dataclasses.replace(self, **changes)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` for a setting that cannot work."""
        self._validate_common()
        self._validate_producer()
        self._validate_scheduler()
        self._validate_worker()


#: renamed settings: old name → new name. The old ``AX_*`` variable (and keyword) is still
#: read when the new one is not given, with a warning in the log.
RENAMED = {"max_held": "max_loaded", "node_lease_s": "id_reservation_s"}


def _renamed(values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``values`` with each old name of :data:`RENAMED` taken for its new one (unless the
    new one is there too), and a warning logged for each."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            value = out.pop(old)
            shown = f"AX_{old.upper()}" if what == "variable" else old
            log.warning("the %s %s is deprecated; use %s", what, shown,
                        f"AX_{new.upper()}" if what == "variable" else new)
            out.setdefault(new, value)
    return out


#: settings given as a duration with a unit (``AX_RETENTION=7d``); a bare number is seconds
_DURATIONS = frozenset({"retention"})


def _coerce(name: str, kind: Any, raw: str) -> Any:
    kind_name = kind if isinstance(kind, str) else kind.__name__
    if name in _DURATIONS:
        try:
            return parse_duration_ms(raw)
        except ConfigurationError:
            raise ConfigurationError(f"AX_{name.upper()}={raw!r} is not a duration "
                                     "(e.g. 7d, 12h; unset: off)") from None
    try:
        if kind_name == "bool":
            if raw.lower() not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                raise ValueError(raw)
            return raw.lower() in {"1", "true", "yes", "on"}
        if kind_name == "int":
            return parse_duration_ms(raw) if name.endswith("_ms") and not raw.isdigit() else int(raw)
        if kind_name == "float":
            return float(raw)
    except ValueError:
        raise ConfigurationError(f"AX_{name.upper()}={raw!r} is not a valid {kind_name}") from None
    return raw


#: the settings :func:`ax_kombu.configure` set in this process, above ``AX_*`` variables;
#: the process's clients (:func:`ax_kombu.client`, :func:`ax_kombu.aio.client`) are made
#: from them. Changed in place, read at each use.
process_overrides: dict[str, Any] = {}


def from_env(environ: Mapping[str, str] | None = None, /, **overrides: Any) -> Settings:
    """Defaults, then ``AX_*`` variables from ``environ``, then ``overrides``."""
    environ = os.environ if environ is None else environ
    kinds = {f.name: f.type for f in fields(Settings)}
    read: dict[str, Any] = {}
    for name, kind in [*kinds.items(), *((old, kinds[new]) for old, new in RENAMED.items())]:
        raw = environ.get(f"AX_{name.upper()}")
        if raw is not None:
            read[name] = _coerce(name, kind, raw)
    values = _renamed(read, "variable")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings().replace(**values)
