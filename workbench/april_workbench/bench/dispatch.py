"""veRL's synchronous baseline dispatch: the batch split in equal chunks per rollout worker, up front.

CoPRIS' baseline is veRL (main, August 2025) with vLLM 0.8.4 in its default synchronous rollout:
``generate_sequences`` is dispatched ``DP_COMPUTE_PROTO``, i.e. the batch is cut into one equal,
contiguous chunk of prompts per data-parallel rollout worker, and each worker's vLLM generates the
``n`` samples of its own prompts. A worker whose chunk is short idles until the longest chunk is
done (CoPRIS §3.2, fig. 1b: "some rollout workers finish early and sit idle until stragglers
complete"). The bench's ``sync`` sends each request to the least-loaded engine instead (slime
behind sglang-router, and veRL's later agent loop), which keeps every engine busy until the
batch's last requests; ``sync-split`` is the veRL baseline.

``SplitDispatch`` wraps the bench's transport: every ``/generate`` of prompt ``i`` (rid
``p<i>/<j>#<k>``, the bench's synthetic prompts) goes to engine ``(i mod batch) * engines //
batch``, whatever engine the scheduler picked; everything else passes through (the scheduler's
health probes included: a probe goes to the engine it names). Only a policy that submits exactly
one batch per step and never aborts (``sync``) can run this way.
"""

from __future__ import annotations

from typing import Any


class SplitDispatch:
    """A transport that sends prompt ``i``'s requests to the engine owning its chunk of the batch."""

    def __init__(self, inner: Any, engine_urls: list[str], prompts_per_step: int):
        if prompts_per_step < 1 or not engine_urls:
            raise ValueError("split dispatch needs engines and at least one prompt per step")
        self.inner = inner
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.prompts_per_step = prompts_per_step
        self.routed = [0] * len(self.engine_urls)  # requests sent to each engine (checked by tests)

    def engine_of(self, rid: str) -> int | None:
        """The engine of a bench prompt's request (rid ``p<i>/<j>#<k>``); None for any other rid."""
        head = rid.split("/", 1)[0]
        if "/" not in rid or not head.startswith("p") or not head[1:].isdigit():
            return None
        return (int(head[1:]) % self.prompts_per_step) * len(self.engine_urls) // self.prompts_per_step

    async def request(self, method: str, url: str, path: str, payload: dict | None,
                      timeout_s: float) -> Any:
        if method == "POST" and path == "/generate" and url.rstrip("/") in self.engine_urls and payload:
            engine = self.engine_of(str(payload.get("rid", "")))
            if engine is not None:
                self.routed[engine] += 1
                url = self.engine_urls[engine]
        return await self.inner.request(method, url, path, payload, timeout_s)

    async def close(self) -> None:
        await self.inner.close()
