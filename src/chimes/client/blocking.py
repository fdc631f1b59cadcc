""":class:`Client`: the same client for code without an event loop. It owns a private event loop
on a thread of its own and runs :class:`~chimes.client.asynchronous.AsyncClient`'s coroutines there,
so there is one implementation of every request, retry and error; the methods here are aliases
(:func:`_blocking`, :func:`_blocking_iter`) whose signatures and types come from the async ones, and
tests/unit/test_client.py checks that no async method lacks its alias.

A private loop rather than ``asyncio.run`` per call: the HTTP connections (and their keep-alive)
belong to one loop for the client's life, and it works where a loop is already running in the
calling thread (a notebook, an async test calling sync code).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from chimes.client.asynchronous import AsyncCalendars, AsyncClient, AsyncJobs, AsyncNotifications, AsyncRuns
from chimes.client.models import Identity

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


class _Loop:
    """An event loop running on a daemon thread; :meth:`run` blocks the caller until a coroutine ends."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="chimes-client", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:  # Ctrl-C while waiting: stop the request too
            future.cancel()
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        async def next_item() -> T:
            return await anext(items)

        try:
            while True:
                try:
                    yield self.run(next_item())
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(items, "aclose", None)
            if close is not None and not self.loop.is_closed():
                self.run(close())

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class _Resource(Generic[R]):
    def __init__(self, loop: _Loop, resource: R) -> None:
        self._loop = loop
        self._async = resource


def _blocking(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[_Resource[Any], P], T]:
    """The async ``method`` of a resource, run to its end on the client's loop."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: _Resource[Any], /, *args: P.args, **kwargs: P.kwargs) -> T:
        bound: Callable[P, Coroutine[Any, Any, T]] = getattr(self._async, name)
        return self._loop.run(bound(*args, **kwargs))

    return call


def _blocking_iter(
    method: Callable[Concatenate[Any, P], AsyncIterator[T]],
) -> Callable[Concatenate[_Resource[Any], P], Iterator[T]]:
    """The async iterator ``method`` of a resource as a plain iterator (one page fetched at a time)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: _Resource[Any], /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._loop.iterate(getattr(self._async, name)(*args, **kwargs))

    return call


class Jobs(_Resource[AsyncJobs]):
    __doc__ = AsyncJobs.__doc__
    create = _blocking(AsyncJobs.create)
    get = _blocking(AsyncJobs.get)
    preview = _blocking(AsyncJobs.preview)
    page = _blocking(AsyncJobs.page)
    list = _blocking_iter(AsyncJobs.list)
    update = _blocking(AsyncJobs.update)
    delete = _blocking(AsyncJobs.delete)
    pause = _blocking(AsyncJobs.pause)
    pauses = _blocking(AsyncJobs.pauses)
    resume = _blocking(AsyncJobs.resume)
    run_now = _blocking(AsyncJobs.run_now)
    backfill = _blocking(AsyncJobs.backfill)


class Runs(_Resource[AsyncRuns]):
    __doc__ = AsyncRuns.__doc__
    page = _blocking(AsyncRuns.page)
    list = _blocking_iter(AsyncRuns.list)
    get = _blocking(AsyncRuns.get)
    cancel = _blocking(AsyncRuns.cancel)
    rerun = _blocking(AsyncRuns.rerun)


class Notifications(_Resource[AsyncNotifications]):
    __doc__ = AsyncNotifications.__doc__
    page = _blocking(AsyncNotifications.page)
    list = _blocking_iter(AsyncNotifications.list)


class Calendars(_Resource[AsyncCalendars]):
    __doc__ = AsyncCalendars.__doc__
    put = _blocking(AsyncCalendars.put)
    get = _blocking(AsyncCalendars.get)
    list = _blocking(AsyncCalendars.list)
    delete = _blocking(AsyncCalendars.delete)


class Client:
    """The Chimes API from plain code; the arguments are :class:`AsyncClient`'s, except that ``sleep``
    may also be a plain function (it then blocks the client's own loop, which nothing else uses).
    Use as ``with Client() as chimes:``, or call :meth:`close`."""

    def __init__(self, base_url: str | None = None, token: str | None = None, **options: Any) -> None:
        sleep = options.get("sleep")
        if sleep is not None and not inspect.iscoroutinefunction(sleep):
            async def waiting(seconds: float) -> None:
                sleep(seconds)

            options["sleep"] = waiting
        self._async = AsyncClient(base_url, token, **options)
        self._loop = _Loop()
        self.base_url = self._async.base_url
        self.jobs = Jobs(self._loop, self._async.jobs)
        self.runs = Runs(self._loop, self._async.runs)
        self.notifications = Notifications(self._loop, self._async.notifications)
        self.calendars = Calendars(self._loop, self._async.calendars)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.loop.is_closed():
            self._loop.run(self._async.aclose())
            self._loop.close()

    def whoami(self) -> Identity:
        return self._loop.run(self._async.whoami())

    def call(self, method: str, path: str, **options: Any) -> Any:
        """Any endpoint (see :meth:`AsyncClient.call`)."""
        return self._loop.run(self._async.call(method, path, **options))
