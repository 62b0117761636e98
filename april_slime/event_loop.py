"""Where the rollout's coroutines run: slime's persistent event loop, or the plugin's own.

slime keeps one event loop for its rollout code and HTTP clients (``slime.utils.async_utils.run``);
the rollout runs there when slime is importable, else on a loop of its own on a daemon thread.
"""

from __future__ import annotations

import asyncio
import threading

from april_slime.samples import slime_attr


def run_on_loop(coro):
    """Run on slime's persistent event loop when slime is there (its own rollout code and HTTP
    clients live on that loop), else on the plugin's own persistent loop. A persistent loop is
    needed either way: the engine client's HTTP session is bound to the loop that created it."""
    try:
        run = slime_attr("slime.utils.async_utils", "run")
    except ImportError:
        run = _own_loop().run
    return run(coro)


class _OwnLoop:
    """The plugin's own persistent event loop, on a daemon thread (for processes without slime)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="april-rollout-loop", daemon=True).start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_OWN_LOOP: _OwnLoop | None = None
_OWN_LOOP_LOCK = threading.Lock()


def _own_loop() -> _OwnLoop:
    global _OWN_LOOP
    with _OWN_LOOP_LOCK:
        if _OWN_LOOP is None:
            _OWN_LOOP = _OwnLoop()
        return _OWN_LOOP
