"""Operator settings for the security of the API and the workers: flags, each with a CHIMES_* variable.

The secret key itself has no flag (a flag would show in ``ps`` and shell history): it is read from
``CHIMES_SECRET_KEY`` or from the key file (``--secret-key-file``, default ``<data-dir>/secret.key``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from chimes.api.limits import LimitSettings
from chimes.security.secrets import (
    KEY_ENV,
    KEY_FILE_NAME,
    Keyring,
    SecretKeyError,
    default_keyring,
    load_keyring,
)
from chimes.security.ssrf import LOOPBACK, EgressPolicy
from chimes.services.owners import check_secret_key
from chimes.store import db
from chimes.worker.tiers import OWNER_SHARE

_DEFAULTS = LimitSettings()
log = logging.getLogger("chimes.security")


@dataclass(frozen=True, slots=True)
class WorkerSecurity:
    allow_commands: bool
    egress: EgressPolicy
    keyring: Keyring
    owner_share: float = OWNER_SHARE  # the most of a worker's slots one owner's runs hold


@dataclass(frozen=True, slots=True)
class ApiSecurity:
    limits: LimitSettings
    keyring: Keyring
    trusted_proxies: tuple[str, ...] = ()  # addresses or networks whose X-Forwarded-For is believed


def _option(*names: str, env: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(*names, envvar=env, show_envvar=True, **kwargs)


def key_file_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return _option("--secret-key-file", env="CHIMES_SECRET_KEY_FILE", type=click.Path(path_type=Path), default=None,
                   help=f"File holding the key that seals secrets, made if missing (default: <data-dir>/"
                        f"{KEY_FILE_NAME}); {KEY_ENV}, when set, wins. Every process needs the same key.")(func)


def api_security_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        _option("--max-body-bytes", env="CHIMES_MAX_BODY_BYTES", type=click.IntRange(1024), show_default=True,
                default=_DEFAULTS.max_body_bytes, help="Largest request body; larger ones get 413."),
        _option("--write-rate", env="CHIMES_WRITE_RATE", type=click.FloatRange(0), show_default=True,
                default=_DEFAULTS.writes_per_sec,
                help="Writes a second per token, per API process (then 429 with Retry-After); 0: no limit."),
        _option("--write-burst", env="CHIMES_WRITE_BURST", type=click.IntRange(1), show_default=True,
                default=_DEFAULTS.write_burst, help="Writes a token may make at once before --write-rate applies."),
        _option("--auth-failure-rate", env="CHIMES_AUTH_FAILURE_RATE", type=click.FloatRange(0.01),
                show_default=True, default=_DEFAULTS.auth_failures_per_min,
                help="Failed authentications a minute per client address (then 429)."),
        _option("--auth-failure-burst", env="CHIMES_AUTH_FAILURE_BURST", type=click.IntRange(1), show_default=True,
                default=_DEFAULTS.auth_failure_burst, help="Failed authentications at once per client address."),
        _option("--default-job-quota", env="CHIMES_DEFAULT_JOB_QUOTA", type=click.IntRange(0), show_default=True,
                default=_DEFAULTS.default_job_quota,
                help="Jobs per owner without a quota of its own (chimes owner set); 0: no limit."),
        _option("--trusted-proxy", env="CHIMES_TRUSTED_PROXIES", multiple=True, metavar="ADDRESS|NET", default=(),
                help="Proxies (10.0.0.5, 10.0.0.0/24) whose X-Forwarded-For names the client, for the failed-login "
                     "limit and logs (repeatable; in the variable, comma-separated). Default: none, the client "
                     "is the connection's address."),
        _option("--request-timeout", env="CHIMES_API_REQUEST_TIMEOUT_SEC", type=click.FloatRange(0.5),
                show_default=True, default=_DEFAULTS.request_timeout_sec,
                help="Seconds a request may take; a request still waiting on the database then gets 503 "
                     "with Retry-After."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def worker_security_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        _option("--egress-allow", env="CHIMES_EGRESS_ALLOW", multiple=True, metavar="NET|HOST",
                help="Only these networks (10.0.0.0/8), addresses or hosts (api.example.com, *.example.com) may "
                     "be called by HTTP tasks and failure webhooks (repeatable; in the variable, comma-separated).",
                default=()),
        _option("--egress-deny", env="CHIMES_EGRESS_DENY", multiple=True, metavar="NET|HOST", default=(),
                help="Networks, addresses or hosts HTTP tasks and webhooks may never call, on top of the defaults "
                     "(repeatable)."),
        _option("--egress-default-deny/--no-egress-default-deny", env="CHIMES_EGRESS_DEFAULT_DENY", default=True,
                show_default=True, help="Deny link-local and cloud metadata addresses (169.254.0.0/16, fe80::/10, "
                                        "fd00:ec2::254, ...)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def egress_loopback_option(default: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return _option("--egress-allow-loopback/--egress-deny-loopback", env="CHIMES_EGRESS_ALLOW_LOOPBACK",
                   default=default, show_default=True,
                   help="Let HTTP tasks and webhooks call this host's own addresses (127.0.0.0/8, ::1): its other "
                        "services would answer a team's task. Private ranges stay allowed either way.")


def owner_share_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return _option("--owner-share", env="CHIMES_OWNER_SHARE", default=OWNER_SHARE, show_default=True,
                   type=click.FloatRange(0.01, 1.0),
                   help="The most of this worker's slots the runs of one owner may hold, so that one team's "
                        "long runs leave room for other teams' (1.0: a fleet that serves one team).")(func)


def allow_commands_option(default: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return _option("--allow-commands/--no-allow-commands", env="CHIMES_ALLOW_COMMANDS", default=default,
                   show_default=True,
                   help="Run command and container tasks (only for owners allowed with chimes owner set).")


def _entries(values: tuple[str, ...]) -> list[str]:
    # A variable holds one comma-separated value; flags may be repeated: accept both.
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def keyring_from(data_dir: Path, secret_key_file: Path | None) -> Keyring:
    try:
        return load_keyring(os.environ.get(KEY_ENV), secret_key_file or data_dir / KEY_FILE_NAME)
    except (SecretKeyError, OSError) as exc:
        raise click.UsageError(f"secret key: {exc}") from None


def worker_security(data_dir: Path, options: dict[str, Any]) -> WorkerSecurity:
    """From the options of :func:`worker_security_options`, :func:`egress_loopback_option`,
    :func:`allow_commands_option`, :func:`owner_share_option` and the key file."""
    return WorkerSecurity(bool(options.get("allow_commands")), egress_policy(options),
                          keyring_from(data_dir, options.get("secret_key_file")),
                          float(options.get("owner_share", OWNER_SHARE)))


def egress_policy(options: dict[str, Any]) -> EgressPolicy:
    """The egress policy the options of a role's command line describe; loopback denied unless allowed."""
    try:
        policy = EgressPolicy.build(allow=_entries(options.get("egress_allow", ())),
                                    deny=_entries(options.get("egress_deny", ())),
                                    default_deny=options.get("egress_default_deny", True),
                                    allow_loopback=bool(options.get("egress_allow_loopback", False)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--egress-allow/--egress-deny") from None
    log_default_overlaps(policy)
    return policy


def log_default_overlaps(policy: EgressPolicy) -> None:
    """Say at start-up what an allow entry did to a default-denied network, so neither a lifted default
    nor one that stays denied under a wide allow entry is a surprise at the first run."""
    for overlap in policy.lifted:
        log.warning("egress: %s is allowed (--egress-allow), lifting that part of the default-denied %s",
                    overlap.allowed, overlap.default)
    for overlap in policy.kept:
        log.warning("egress: %s stays denied although --egress-allow %s covers it; name it (--egress-allow %s%s) "
                    "to allow it", overlap.default, overlap.allowed, overlap.default,
                    " or --egress-allow-loopback" if str(overlap.default) in LOOPBACK else "")


def api_security(data_dir: Path, options: dict[str, Any]) -> ApiSecurity:
    """From the options of :func:`api_security_options` and the key file."""
    limits = LimitSettings(
        max_body_bytes=options["max_body_bytes"], writes_per_sec=options["write_rate"],
        write_burst=options["write_burst"], auth_failures_per_min=options["auth_failure_rate"],
        auth_failure_burst=options["auth_failure_burst"], default_job_quota=options["default_job_quota"] or None,
        request_timeout_sec=options["request_timeout"],
    )
    return ApiSecurity(limits, keyring_from(data_dir, options.get("secret_key_file")),
                       trusted_proxies(_entries(options.get("trusted_proxy", ()))))


def trusted_proxies(entries: list[str]) -> tuple[str, ...]:
    """Addresses and networks, checked now so a typo is a start-up error, not a proxy silently untrusted."""
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise click.BadParameter(f"{entry!r} is not an IP address or network (10.0.0.5, 10.0.0.0/24)",
                                     param_hint="--trusted-proxy") from None
    return tuple(entries)


class ImportKey:
    """The secret key of ``chimes jobs import``, loaded and checked against the database's only once a
    line has secret values to seal: an import without secrets needs no key."""

    def __init__(self, data_dir: Path | None) -> None:
        self._data_dir = data_dir
        self.keyring: Keyring | None = None

    async def load(self, conn: db.Connection) -> Keyring:
        if self.keyring is None:
            keyring = keyring_from(self._data_dir, None) if self._data_dir else default_keyring()
            try:
                await check_secret_key(conn, keyring)
            except SecretKeyError as exc:
                raise click.ClickException(str(exc)) from None
            self.keyring = keyring
        return self.keyring
