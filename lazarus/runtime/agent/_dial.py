"""How an agent reaches its controller: one attempt (connect, register, read the answer),
the attempts' count and last failure (for the "still trying" lines), the pacing of
reconnections, and the first registration's retry loop (``connect_timeout``).

:class:`~._agent.Agent` owns one :class:`Dialer`; the reconnection loop after a loss
stays with the agent (it reads and rebuilds the agent's link state) and uses the
dialer's attempts and pacing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._backoff import Backoff
from .._config import AgentConfig
from .._wire import (PLAN_MAX_MESSAGE_BYTES, AuthRefusedError, ConnectionClosed, MalformedMessageError, ProtocolError,
                     encode_frame, read_frame)
from ._exit_codes import EXIT_FAILED

__all__ = ["Dialer", "Unreachable", "RECONNECT_PROGRESS_EVERY"]

log = logging.getLogger("lazarus.agent")

#: Pauses between connection attempts: before the first registration, and after a loss
#: (at most a second: a restarted controller gets its members back within about one).
_CONNECT_BACKOFF = (timedelta(milliseconds=100), timedelta(seconds=2))
_RECONNECT_BACKOFF = (timedelta(milliseconds=100), timedelta(seconds=1))
#: Longest wait for a TCP connection, and for the controller's answer to a registration.
_ATTEMPT_TIMEOUT = timedelta(seconds=10)
#: How often an agent that cannot reach the controller says it is still trying.
_CONNECT_PROGRESS_EVERY = timedelta(seconds=5)
RECONNECT_PROGRESS_EVERY = timedelta(seconds=30)



class Unreachable(Exception):
    """One attempt to reach the controller failed (the reason is the message)."""


def _describe(exc: BaseException) -> str:
    """An attempt's failure in words."""
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer within the attempt's timeout"
    if isinstance(exc, ConnectionClosed):
        return ("the controller closed the connection without answering the registration (a controller older "
                "than this agent does so on a wrong secret)")
    if isinstance(exc, ProtocolError):
        return f"the peer does not speak the Lazarus protocol with our secret ({exc})"
    return str(exc) or type(exc).__name__



def _finish(exit: asyncio.Future[int], rc: int) -> None:
    if not exit.done():
        exit.set_result(rc)


class Dialer:
    """Reaches the controller for one agent (``node_id``); ``register_msg(resume)`` is the
    registration the agent sends."""

    def __init__(self, config: AgentConfig, *, node_id: str,
                 register_msg: Callable[[bool], dict[str, Any]]) -> None:
        self.config = config
        self.node_id = node_id
        self._register_msg = register_msg
        # reconnection pacing; reset each time the controller accepts the node
        self.backoff = Backoff(*_RECONNECT_BACKOFF)
        self.attempts = 0                     # connection attempts since the node was last accepted
        self.last_failure = ""                # why the latest of them failed

    def accepted(self) -> None:
        """The controller accepted the node: pacing and count start afresh."""
        self.backoff.reset()
        self.attempts, self.last_failure = 0, ""

    @property
    def address(self) -> str:
        return f"{self.config.controller_host}:{self.config.controller_port}"

    def secret_refused(self) -> str:
        """What to do about a secret the controller refused."""
        src = self.config.secret_source
        return (f"the controller at {self.address} refused this agent's secret (HMAC mismatch): it is not the "
                f"controller's. Give the controller and every agent the same secret (at least 16 bytes, "
                f"surrounding whitespace ignored): --secret-file PATH, or the environment variable LAZARUS_SECRET "
                f"when --secret-file is not given" + (f"; this agent's came from {src}" if src else ""))

    @staticmethod
    async def _unless_exiting(exit: asyncio.Future[int], coro: Any) -> Any:
        """Await ``coro``, or cancel it when the agent is told to exit meanwhile (then None)."""
        task = asyncio.ensure_future(coro)
        await asyncio.wait([task, exit], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return None
        return task.result()

    async def _handshake(self, resume: bool, deadline: float
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]:
        """One attempt: connect, register, read the controller's answer ("registered" or
        "error"). Raises what went wrong (:class:`AuthRefusedError`: a wrong secret)."""
        cfg = self.config
        limit = _ATTEMPT_TIMEOUT.total_seconds()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(cfg.controller_host, cfg.controller_port),
            min(limit, max(0.1, deadline - time.monotonic())))
        try:
            writer.write(encode_frame(cfg.secret, self._register_msg(resume)))
            first = await asyncio.wait_for(
                read_frame(reader, cfg.secret, max(cfg.max_message_bytes, PLAN_MAX_MESSAGE_BYTES)),
                min(limit, max(0.5, deadline - time.monotonic())))
            if first["type"] not in ("registered", "error"):
                raise MalformedMessageError(f"the controller answered the registration with {first['type']!r}")
        except BaseException:
            writer.close()
            raise
        return reader, writer, first

    async def attempt(self, resume: bool, deadline: float
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]:
        """:meth:`_handshake`, counted; a failure other than a refused secret is raised as
        :class:`Unreachable` and kept for the progress lines."""
        self.attempts += 1
        try:
            return await self._handshake(resume, deadline)
        except AuthRefusedError:
            self.last_failure = "the controller refused our secret (HMAC mismatch)"
            raise
        except (OSError, asyncio.TimeoutError, ProtocolError) as exc:
            self.last_failure = _describe(exc)
            raise Unreachable(self.last_failure) from None

    async def say_still_trying(self, deadline: float, what: str, option: str, every: timedelta) -> None:
        """Every ``every``, while reaching the controller: where, how often, for how long."""
        while True:
            await asyncio.sleep(every.total_seconds())
            left = max(0.0, deadline - time.monotonic())
            log.warning("agent %s: %s the controller at %s: %d attempt%s so far, last error: %s; %.0f s left of "
                        "%s", self.node_id, what, self.address, self.attempts, "" if self.attempts == 1 else "s",
                        self.last_failure or "none yet", left, option)

    async def reach(self, exit: asyncio.Future[int]
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]] | None:
        """Connect and register, retrying with backoff for up to ``connect_timeout``.
        None when the agent exits instead (gave up, the secret refused, a signal): its exit
        code is set."""
        cfg = self.config
        timeout = cfg.connect_timeout.total_seconds()
        deadline = time.monotonic() + timeout
        backoff = Backoff(*_CONNECT_BACKOFF)
        self.attempts, self.last_failure = 0, ""
        ticker = asyncio.ensure_future(self.say_still_trying(deadline, "still trying to reach", "--connect-timeout",
                                                             _CONNECT_PROGRESS_EVERY))
        try:
            while not exit.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await self._unless_exiting(exit, asyncio.sleep(min(backoff.next_delay().total_seconds(), left)))
                if exit.done():
                    return None
                try:
                    got = await self._unless_exiting(exit, self.attempt(False, deadline))
                except AuthRefusedError:
                    log.error("agent %s: %s. No worker was started; exiting %d.", self.node_id,
                              self.secret_refused(), EXIT_FAILED)
                    _finish(exit, EXIT_FAILED)
                    return None
                except Unreachable as exc:
                    if self.attempts == 1:
                        log.warning("agent %s: cannot reach the controller at %s yet (%s); retrying for up to %.0f s "
                                    "(--connect-timeout); the worker starts once the controller accepts this node",
                                    self.node_id, self.address, exc, timeout)
                    continue
                if got is not None:
                    return got
            if exit.done():
                return None
            if self.last_failure.startswith("the controller closed the connection"):
                hint = ("Does it have this agent's secret (--secret-file PATH or LAZARUS_SECRET on both "
                        "sides)?")
            else:
                hint = ("Is the controller running, listening on that address (its --host and --port), and "
                        "reachable from this host?")
            log.error("agent %s: gave up reaching the controller at %s after %.0f s (--connect-timeout) and %d "
                      "attempt%s; last error: %s. %s No worker was started; exiting %d.",
                      self.node_id, self.address, timeout, self.attempts, "" if self.attempts == 1 else "s",
                      self.last_failure or "none", hint, EXIT_FAILED)
            _finish(exit, EXIT_FAILED)
            return None
        finally:
            ticker.cancel()
