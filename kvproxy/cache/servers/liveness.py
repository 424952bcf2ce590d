"""A server found hung, and what its waiting requests do then: go to another server.

With several servers, housekeeping looks at each every few seconds (GET /props, which a
healthy server answers at once, even mid-prefill) and takes one that gives no answer within
its deadline out of rotation (backend.py). New requests then go elsewhere. A request already
on that server when it hung waits for one of: a slot there, kvproxy's own calls to it (a
restore, a save, an opening's prefill: no deadline, their length grows with their tokens),
the first byte of the reply (a long prefill legitimately sends none for minutes). No fixed
timeout tells those from slow work; the server's liveness does: the cheap look that hangs too.

So such a request, until a byte of its reply goes to the client, waits for its work or for
its server to be found hung while another server of the same model is in rotation, whichever
comes first. Found hung, it gives up its place: what it was waiting for is cancelled (slot
work kvproxy had started on a slot goes on to its end, the slot held until then:
leases.py; an abandoned forward closes its connection, which tells the server to drop it once
it runs again), and the router sends the request to another server. With nowhere else to go
it waits on, as it would without kvproxy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvproxy.http.session import UpstreamError

_T = TypeVar("_T")

# While the server is hung but no other is in rotation, how often a waiting request looks
# again whether one is.
RECHECK_S = 1.0


class Hung(UpstreamError):
    """The request's server was found hung before any byte of its reply went out."""


def no_answer(exc: UpstreamError) -> bool:
    """Whether a failed look got no answer at all within its deadline (a hung server), as
    opposed to a refused connection or an error status (which reach waiting requests too)."""
    return isinstance(exc.__cause__, TimeoutError)


class Liveness:
    """One server's: whether its last look found it hung. `elsewhere` says whether another
    server could take its requests now (set by the cache for a server among several)."""

    def __init__(self) -> None:
        self._hung = asyncio.Event()
        self.elsewhere: Callable[[], bool] | None = None

    def found_hung(self) -> None:
        self._hung.set()

    def answered(self) -> None:
        if self._hung.is_set():
            self._hung = asyncio.Event()  # requests that woke on the old one have gone

    @property
    def hung(self) -> bool:
        return self._hung.is_set()

    async def _given_up(self) -> None:
        """Returns once the server is found hung while another one is in rotation."""
        while True:
            await self._hung.wait()
            if self.elsewhere is not None and self.elsewhere():
                return
            await asyncio.sleep(RECHECK_S)

    async def unless_hung(self, work: Awaitable[_T]) -> _T:
        """`work`'s result; Hung if the server is found hung first while another could take
        the request. A lone server's requests just wait for `work`.

        `work` runs in the caller's task (a slot is taken without a pause, as before): when
        the server is found hung, that task is cancelled, as a client hanging up cancels it,
        so `work` cleans up as it does then, and the cancellation comes back as Hung (as
        asyncio.timeout turns its own into TimeoutError)."""
        if self.elsewhere is None:
            return await work
        task = asyncio.current_task()
        assert task is not None
        waiting = True
        fired = False

        def give_up(watch: asyncio.Future[None]) -> None:
            nonlocal fired
            if waiting and not watch.cancelled():
                fired = True
                task.cancel()

        watch = asyncio.ensure_future(self._given_up())
        watch.add_done_callback(give_up)
        try:
            result = await work
        except asyncio.CancelledError:
            # Ours alone (the client still there): Hung; the client's too: cancelled.
            if fired and task.uncancel() == 0:
                raise Hung("no answer: found hung while a request waited on it") from None
            raise
        finally:
            waiting = False
            watch.cancel()
        if fired:
            task.uncancel()  # `work` ended anyway, its cancellation absorbed
        return result
