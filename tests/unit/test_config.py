from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from ax_kombu.config import RENAMED, Settings, from_env, parse_duration_ms
from ax_kombu.config_sections import (
    CommonSettings,
    ProducerSettings,
    SchedulerSettings,
    WorkerSettings,
)
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.observability.redaction import redact_url


def test_precedence_defaults_env_overrides() -> None:
    assert from_env({}).database_url.startswith("sqlite:///")
    env = {"AX_DATABASE_URL": "postgresql://h/db", "AX_DEDUP_WINDOW_MS": "2s",
           "AX_AUTO_MIGRATE": "yes", "AX_RECOVERY_INTERVAL_S": "1.5"}
    settings = from_env(env)
    assert settings.database_url == "postgresql://h/db"
    assert settings.dedup_window_ms == 2000 and settings.auto_migrate is True
    assert settings.recovery_interval_s == 1.5
    assert from_env(env, database_url="sqlite:///x.db").database_url == "sqlite:///x.db"


@pytest.mark.parametrize("env", [{"AX_CLAIM_BATCH": "many"}, {"AX_AUTO_MIGRATE": "perhaps"},
                                 {"AX_CLAIM_BATCH": "0"}, {"AX_QUEUE_SLOW": "default"}])
def test_bad_values_are_clear_errors(env: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError):
        from_env(env)


def test_unknown_override_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown setting"):
        from_env({}, databse_url="x")


@pytest.mark.parametrize("text,ms", [("250ms", 250), ("5s", 5000), ("2m", 120_000),
                                     ("1.5h", 5_400_000), ("3", 3000)])
def test_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


def test_passwords_never_shown() -> None:
    assert redact_url("amqp://guest:s3cret@host:5672/v") == "amqp://guest:***@host:5672/v"
    assert redact_url("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("text,shown", [
    ("https://h/cb?token=s3cr3t-tok", "https://h/cb?token=***"),
    ("https://h/cb?a=1&sig=x;k=v#frag", "https://h/cb?a=***&sig=***;k=***#frag"),
    ("redis://:pw@h:6379/0?token=t", "redis://:***@h:6379/0?token=***"),
    ("postgresql://u:p@h/db?sslmode=verify-full&sslpassword=x",
     "postgresql://u:***@h/db?sslmode=verify-full&sslpassword=***"),
    ("callback failed: <urlopen error http://h/x?token=t> and amqp://g:pw@h//",
     "callback failed: <urlopen error http://h/x?token=***> and amqp://g:***@h//"),
    ("url='ax+sqlite:///b.db?token=t'", "url='ax+sqlite:///b.db?token=***'"),
    ("host=h password=s3cr3t dbname=x", "host=h password=*** dbname=x"),
    ("no url here", "no url here"),
])
def test_tokens_in_query_strings_and_text_never_shown(text: str, shown: str) -> None:
    assert redact_url(text) == shown
    assert redact_url(shown) == shown


@pytest.mark.parametrize("text", [
    "a" * 2_000_000,                          # a long run of scheme letters, no "://"
    "x://" + "b:c://" * 333_333,              # many "user:" heads, no "@" after them
    "a://" + ":" * 2_000_000,
    "http://h/?" + "&" * 2_000_000,
    "a+" * 1_000_000 + "b",
    "redis://u:p@h/0?token=t&sslmode=require password=s " * 35_000,
], ids=["letters", "userinfo-heads", "colons", "ampersands", "scheme-chars", "urls"])
def test_redaction_is_linear_on_long_text(text: str) -> None:
    """2 MB of text is redacted in well under a second (the unbounded scheme made 16 k
    letters take 0.18 s, 200 k take 28 s)."""
    started = time.perf_counter()
    shown = redact_url(text)
    assert time.perf_counter() - started < 1.0
    assert "p@h" not in shown and "token=t&" not in shown


def test_a_scheme_longer_than_the_bound_is_still_redacted() -> None:
    scheme = "x" * 40
    assert redact_url(f"{scheme}://u:pw@h/?token=t") == f"{scheme}://u:***@h/?token=***"
    assert redact_url("a://u:pw@h/x@y") == "a://u:***@h/x@y"


def test_retention_is_off_unless_set_and_takes_a_duration() -> None:
    assert from_env({}).retention == 0
    assert from_env({"AX_RETENTION": "7d"}).retention == 7 * 86_400_000
    assert from_env({"AX_RETENTION": "90"}).retention == 90_000  # a bare number is seconds


@pytest.mark.parametrize("env,words", [
    ({"AX_RETENTION": "xyz"}, "AX_RETENTION='xyz' is not a duration"),
    ({"AX_RETENTION": "-1d"}, "AX_RETENTION='-1d' is not a duration"),
    ({"AX_RETENTION_BATCH": "0"}, "retention_batch"),
    ({"AX_RETENTION_INTERVAL_S": "0"}, "retention_interval_s"),
])
def test_bad_retention_settings_are_clear_errors(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        from_env(env)


@pytest.mark.parametrize(("env", "match"), [
    ({"AX_RABBITMQ_QUEUE_TYPE": "stream"}, "rabbitmq_queue_type must be one of classic, quorum"),
    ({"AX_BROKER_TRANSPORT_OPTIONS": "{master_name: x}"}, "not JSON"),
    ({"AX_BROKER_TRANSPORT_OPTIONS": '["master_name"]'}, "must be a JSON object, got list"),
])
def test_broker_options_that_cannot_work_stop_at_start(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        from_env(env)


@pytest.mark.parametrize(("env", "match"), [
    ({"AX_CLAIM_WINDOW_MS": "-5"}, "not a duration: '-5'"),
    ({"AX_CLAIM_WINDOW_MS": "2s"}, "claim_window_ms must be at most 1000, got 2000"),
])
def test_a_claim_window_below_zero_or_past_a_second_is_refused(env: dict[str, str],
                                                               match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        from_env(env)


def test_the_claim_reaches_the_lead_and_the_window_and_no_window_without_a_lead() -> None:
    assert from_env({}).claim_reach_ms == 270
    assert from_env({"AX_CLAIM_WINDOW_MS": "0"}).claim_reach_ms == 250
    assert from_env({"AX_CLAIM_LEAD_MS": "0"}).claim_reach_ms == 0
    # a lead of a second, the most it may be (set before the window existed), stays valid
    assert from_env({"AX_CLAIM_LEAD_MS": "1000"}).claim_reach_ms == 1000
    assert from_env({"AX_CLAIM_LEAD_MS": "990"}).claim_reach_ms == 1000


def test_transport_options_are_merged_over_axs_own() -> None:
    from ax_kombu.broker.connection import connection

    settings = from_env({"AX_BROKER_TRANSPORT_OPTIONS":
                         '{"master_name": "mymaster", "socket_timeout": 3}'},
                        broker_url="sentinel://127.0.0.1:26379/0;sentinel://127.0.0.1:26380/0")
    assert settings.transport_options() == {"master_name": "mymaster", "socket_timeout": 3}
    options = connection(settings).transport_options
    assert options["master_name"] == "mymaster" and options["socket_timeout"] == 3
    assert options["global_keyprefix"] == ""  # ax's own for Redis, Sentinel included
    assert from_env({}).transport_options() == {}


def test_every_setting_is_in_exactly_one_section() -> None:
    sections = [CommonSettings, ProducerSettings, SchedulerSettings, WorkerSettings]
    own = [{f.name for f in dataclasses.fields(s)} for s in sections]
    assert sum(len(names) for names in own) == len(set().union(*own))  # disjoint
    assert set().union(*own) == {f.name for f in dataclasses.fields(Settings)}
    assert "max_loaded" in own[2] and "id_reservation_s" in own[0] and "pool_high" in own[3]


def test_renamed_settings_are_read_by_their_old_names_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    assert RENAMED == {"max_held": "max_loaded", "node_lease_s": "id_reservation_s"}
    with caplog.at_level(logging.WARNING, logger="ax_kombu.config"):
        old = from_env({"AX_MAX_HELD": "1000", "AX_NODE_LEASE_S": "30"})
    assert (old.max_loaded, old.id_reservation_s) == (1000, 30)
    assert "AX_MAX_HELD is deprecated; use AX_MAX_LOADED" in caplog.text
    assert "AX_NODE_LEASE_S is deprecated; use AX_ID_RESERVATION_S" in caplog.text
    both = from_env({"AX_MAX_HELD": "1000", "AX_MAX_LOADED": "2000"})
    assert both.max_loaded == 2000  # the new name wins
    assert from_env({}, max_held=7).max_loaded == 7
    assert Settings().replace(node_lease_s=9).id_reservation_s == 9
    with pytest.raises(ConfigurationError, match="max_loaded must be positive"):
        from_env({"AX_MAX_HELD": "0"})
    assert not hasattr(Settings(), "max_held")
