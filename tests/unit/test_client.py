"""chimes.client without a server: the blocking client is the async one, method for method."""

from __future__ import annotations

import inspect

import pytest

from chimes.client import Client, asynchronous, blocking


@pytest.mark.parametrize(("sync", "async_"), [
    (blocking.Jobs, asynchronous.AsyncJobs),
    (blocking.Runs, asynchronous.AsyncRuns),
    (blocking.Notifications, asynchronous.AsyncNotifications),
    (blocking.Calendars, asynchronous.AsyncCalendars),
])
def test_every_async_method_has_its_blocking_alias(sync: type, async_: type) -> None:
    def public(cls: type) -> set[str]:
        return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}

    assert public(sync) == public(async_)
    for name in public(sync):
        assert inspect.signature(getattr(sync, name)) == inspect.signature(getattr(async_, name))


def test_the_blocking_client_has_the_async_clients_methods() -> None:
    def public(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_")}

    assert public(asynchronous.AsyncClient) - {"aclose", "request"} == public(Client) - {"close"}


def test_a_token_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHIMES_TOKEN", raising=False)
    with pytest.raises(Exception, match="no API token"):
        Client("http://127.0.0.1:9")
