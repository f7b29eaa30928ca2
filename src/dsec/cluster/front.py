"""The gateway's HTTP/1.1 protocol: uvicorn's, with the fast operations answered without the ASGI cycle.

Owns the shortest way from a request on the gateway's socket to the engine for what an RL loop sends
thousands of times a second (create, destroy: the operations declared ``fast``). uvicorn's httptools
protocol parses the request and builds its cycle as usual; where it would start the ASGI application,
:class:`LeanHttp` first asks its :class:`Admission` whether the request is a fast operation this replica
answers itself for a known caller. If so it reads the body, has :meth:`FastPath.answer` parse it and call
the engine, and writes the answer's bytes itself, exactly as uvicorn writes what the ASGI stack sends (the
same status line, the server's default headers, ``content-type`` and ``content-length``); the ASGI layers
(proxy headers, the job guard, the replica router, the fast path's dispatch, every ``send``) cost a
create+destroy about a fifth of the gateway's CPU.

Everything else goes to the ASGI application unchanged: other routes, a caller the job guard would
refuse, a request another replica may own, ``Expect: 100-continue``, and a body the fast path does not
accept (the application then words the 400 from the body already read). It must never answer anything the
application would answer differently.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from dsec.api.binding import FastPath

__all__ = ["Admission", "LeanHttp", "lean_protocol"]

Enter = Callable[[], Callable[[], None]]
"""Sets the caller's context for the call (its job, its token); returns what undoes it."""


class Admission(Protocol):
    """What decides whether a request may take the lean path, and as whom."""

    fast: FastPath
    """The fast operations and how they are answered."""

    def admit(self, scope: dict[str, Any]) -> Enter | None:
        """How to enter the caller's context when this replica answers the request itself with no layer of
        its ASGI stack having a say (a known caller, nothing to pass on); None: the ASGI application decides."""


class LeanHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, with :class:`Admission`'s fast operations answered directly."""

    admission: ClassVar[Admission]
    """Set on the class :func:`lean_protocol` makes for one server (uvicorn makes the protocols)."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        lean = self._lean(cycle, app)
        if lean is None:
            super()._start_asgi_task(cycle, app)
            return
        context = contextvars.Context() if self.config.reset_contextvars else None
        task = self.loop.create_task(self._serve(cycle, app, *lean), context=context)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _lean(self, cycle: RequestResponseCycle, app: Any) -> tuple[Any, dict[str, Any], Enter] | None:
        """The fast operation, its path arguments and the caller's context, if the request may go lean."""
        scope: Any = cycle.scope
        if app is not self.app or cycle.waiting_for_100_continue or scope["http_version"] != "1.1":
            return None  # over the concurrency limit (uvicorn's 503), or what only the full cycle speaks
        matched = self.admission.fast.match(scope["method"], scope["path"])
        if matched is None or matched[0].op.runs_command:
            return None
        enter = self.admission.admit(scope)
        if enter is None:
            return None
        return matched[0], matched[1], enter

    async def _serve(self, cycle: RequestResponseCycle, app: Any, fast: Any, args: dict[str, Any],
                     enter: Enter) -> None:
        try:
            body = b""
            if fast.body is not None:
                while cycle.more_body and not cycle.disconnected:
                    cycle.flow.resume_reading()
                    await cycle.message_event.wait()
                    cycle.message_event.clear()
                if cycle.disconnected:  # gone before its body arrived: nothing to run
                    return
                body = bytes(cycle.body)
            leave = enter()
            try:
                answer = await self.admission.fast.answer(fast, args, cycle.scope, body)  # type: ignore[arg-type]
            finally:
                leave()
            if answer is None:  # the application words the 400, from the body already read
                cycle.body = bytearray(body)
                cycle.message_event.set()
                await cycle.run_asgi(app)
                return
            await _write(cycle, *answer)
        except BaseException as exc:  # as uvicorn's cycle does with what its application raises
            cycle.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not cycle.response_started:
                await cycle.send_500_response()
            else:
                cycle.transport.close()
        finally:
            cycle.on_response = lambda: None


async def _write(cycle: RequestResponseCycle, status: int, payload: bytes) -> None:
    """Write a whole JSON answer as :meth:`RequestResponseCycle.send` writes one the fast path sends, and
    complete the cycle as it does."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    if cycle.access_log and cycle.access_logger.isEnabledFor(logging.INFO):  # its arguments cost a visible share
        scope: Any = cycle.scope
        cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                 get_path_with_query_string(scope), scope["http_version"], status)
    head = [STATUS_LINE[status]]
    head += [b"%s: %s\r\n" % (name, value) for name, value in cycle.default_headers]
    if payload or status != 204:
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(payload))
    if not cycle.keep_alive:
        head.append(b"connection: close\r\n")
    head.append(b"\r\n")
    head.append(payload)
    cycle.transport.write(b"".join(head))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()


def lean_protocol(admission: Admission) -> type[LeanHttp]:
    """The ``http`` protocol class of a ``uvicorn.Config`` that serves ``admission``'s fast operations lean."""
    return type("LeanHttp", (LeanHttp,), {"admission": admission})
