"""What a stream may send so far, and the merge of a batch's streams.

Stop strings: the engine's text of a request can end with the start of a stop string (`"...pt"` for stop "ptre");
if the stop string then completes, the final text drops it. A stream therefore holds back any suffix that is a
prefix of a stop string until it is known not to be one, so the concatenated deltas equal the non-streamed text.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could begin a stop string (the longest such suffix)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class TextDeltas:
    """Turns a request's cumulative texts into the deltas a stream sends (see the module docstring)."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.sent = tuple(stops), 0

    def delta(self, text: str, finished: bool) -> str:
        safe = len(text) if finished else len(text) - held_back(text, self.stops)
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent:safe], safe
        return out


_END = object()


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(index, item) from several async iterators as items arrive; an exception in one is raised here. Closing
    this generator (a client that went away) cancels every stream, which aborts their requests."""
    if len(streams) == 1:  # the common case, without tasks
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]):
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
