"""The episode front: an SGLang-compatible ``/generate`` that episode functions call instead of the router.

slime's custom generate functions (agent coroutines) call the model themselves, with any HTTP client,
at ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``. Under the plugin that URL
points here: the front parses each call as SGLang would, finds the episode by the marker the plugin put
in the function's ``sampling_params`` (``custom_params.april_episode``), and hands the call to
``EpisodeRunner.call``. The scheduler runs it like any trajectory (it may abort it at a step's end and
resume it in a later step) and, once the call is finished, the function gets one ordinary SGLang reply
per call, built here (``sglang_reply``) from every segment: parsing a call and building its reply,
the whole wire of an episode's calls, live in this module.

What the front owns, and why it is built this way:

* it listens on 127.0.0.1 only, on a free port: only the functions of this job, running on this
  process's event loop, are meant to reach it; nothing of the cluster needs it;
* it is bounded: at most ``max_pending`` calls open at once (503 past it) and ``max_body_bytes`` a
  body (413), so a runaway function cannot grow the job's memory without limit;
* it dies with the job: it runs on the caller's event loop, ``close`` stops it, and a dead process
  takes its socket with it (no thread, no child process);
* it refuses what it cannot serve faithfully (batches, streaming, multimodal inputs, embeddings, LoRA,
  hidden states) with SGLang's error shape ``{"error": {"message": ...}}`` naming the field, instead
  of silently answering something else. Routed experts (``return_routed_experts``, from
  ``routed_experts_start_len``) are served: the call's rows over all its segments
  (``sglang_reply``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from april_slime.core.episodes import CallRequest, EpisodeError, ModelCall
from april_slime.core.replay import int32_bytes
from april_slime.core.sglang_protocol import check_token_ids
from april_slime.core.types import Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

EPISODE_MARKER = "april_episode"  # key in sampling_params["custom_params"]
PASS_ON = "pass the sampling_params the generate function was given on to /generate"
# body fields whose presence (not None / False) asks for something a scheduled call cannot give
REFUSED_FIELDS = ("stream", "image_data", "audio_data", "video_data", "input_embeds", "lora_path",
                  "return_hidden_states")


class Refused(ValueError):
    """A request the front answers with an HTTP error (status and SGLang-shaped message)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class EpisodeFront:
    """SGLang's ``/generate`` on 127.0.0.1, answered by an ``EpisodeRunner``."""

    host = "127.0.0.1"

    def __init__(self, runner: Any, *, tokenize: Callable[[str], list[int]], vocab_size: int | None,
                 default_max_new_tokens: int, max_pending: int = 4096, max_body_bytes: int = 64 << 20):
        self.runner = runner  # anything with ``async call(episode_uid, CallRequest) -> dict``
        self.tokenize = tokenize
        self.vocab_size = vocab_size
        self.default_max_new_tokens = default_max_new_tokens
        self.max_pending = max_pending
        self.max_body_bytes = max_body_bytes
        self.pending = 0  # /generate requests open now
        self.port: int | None = None
        self.sock: socket.socket | None = None
        self._app_runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        # handler_cancellation stays off (aiohttp's default): a client that hangs up must not cancel
        # the runner's call, which the scheduler owns; the episode's own cancellation ends it.
        # a suspended episode's request stays open across steps: at close it is cut at once rather
        # than waited for (aiohttp's default waits a minute per site)
        self._app_runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.5)
        await self._app_runner.setup()
        # bind the socket ourselves: port 0 picks a free port and the bound address can be read back
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.port = sock.getsockname()[1]
        await web.SockSite(self._app_runner, sock).start()

    async def close(self) -> None:
        if self._app_runner is not None:
            await self._app_runner.cleanup()
            self._app_runner = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    async def __aenter__(self) -> EpisodeFront:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ handlers
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _generate(self, request: web.Request) -> web.Response:
        if self.pending >= self.max_pending:
            return error_response(503, f"the episode front has {self.pending} requests open "
                                       f"(max_pending={self.max_pending}); retry later")
        self.pending += 1
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return error_response(413, f"request body is larger than max_body_bytes={self.max_body_bytes}")
            try:
                uid, call = self.parse(body)
            except Refused as e:
                return error_response(e.status, str(e))
            try:
                reply = await self.runner.call(uid, call)
            except EpisodeError as e:
                return error_response(400, str(e))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the front itself is shutting down
                # the runner stopped the episode (restart, drop): its function is being cancelled too
                return error_response(503, f"episode {uid} was stopped")
            except Exception as e:
                logger.exception("episode front: call of episode %s failed", uid)
                return error_response(500, f"{type(e).__name__}: {e}")
            return web.json_response(reply)
        finally:
            self.pending -= 1

    # ------------------------------------------------------------------ parsing
    def parse(self, raw: bytes) -> tuple[str, CallRequest]:
        """A ``/generate`` body -> (episode uid, call). Raises ``Refused`` for what cannot be served."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise Refused(f"request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise Refused("request body must be a JSON object")
        for name in REFUSED_FIELDS:
            if body.get(name) not in (None, False):
                raise Refused(f"{name} is not supported by the episode front (one sequential, non-streamed, "
                              "text-only call per request)")
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise Refused("exactly one of input_ids and text must be given")
        if text is not None:
            if isinstance(text, list):
                raise Refused("text: batched requests (a list of texts) are not supported; send one call at a time")
            if not isinstance(text, str):
                raise Refused(f"text must be a string, got {type(text).__name__}")
            ids = list(self.tokenize(text))
        else:
            if not isinstance(ids, list):
                raise Refused(f"input_ids must be a list of token ids, got {type(ids).__name__}")
            if ids and isinstance(ids[0], list):
                raise Refused("input_ids: batched requests (a list of lists) are not supported; "
                              "send one call at a time")
        if not ids:
            raise Refused("input_ids: the prompt is empty")
        try:
            check_token_ids(ids, self.vocab_size, "input_ids")
        except ValueError as e:
            raise Refused(str(e)) from None

        params = body.get("sampling_params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise Refused(f"sampling_params must be an object, got {type(params).__name__}")
        max_new_tokens = params.pop("max_new_tokens", None)
        if max_new_tokens is None:
            max_new_tokens = self.default_max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise Refused(f"sampling_params.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        uid = self._pop_marker(params)
        stop = params.get("stop")
        if stop is None:
            stop_tuple: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stop_tuple = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop_tuple = tuple(stop)
        else:
            raise Refused(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
        return uid, CallRequest(ids, max_new_tokens, params, text=text, stop=stop_tuple,
                                routed_experts_from=self._routed_experts_from(body))

    @staticmethod
    def _routed_experts_from(body: dict) -> int | None:
        """Where the reply's routed experts start, when the request asks for them (as SGLang reads
        ``return_routed_experts`` and ``routed_experts_start_len``)."""
        if not body.get("return_routed_experts"):
            return None
        start = body.get("routed_experts_start_len") or 0
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise Refused(f"routed_experts_start_len must be an integer >= 0, got {start!r}")
        return start

    @staticmethod
    def _pop_marker(params: dict) -> str:
        """Take the episode marker out of ``params`` (it is the plugin's, not the engine's)."""
        custom = params.get("custom_params")
        if custom is not None and not isinstance(custom, dict):
            raise Refused(f"sampling_params.custom_params must be an object, got {type(custom).__name__}")
        uid = custom.get(EPISODE_MARKER) if custom else None
        if not isinstance(uid, str):
            raise Refused(f"sampling_params.custom_params.{EPISODE_MARKER} is missing or not a string: "
                          f"this request belongs to no episode ({PASS_ON})")
        custom = {k: v for k, v in custom.items() if k != EPISODE_MARKER}
        if custom:
            params["custom_params"] = custom
        else:
            del params["custom_params"]
        return uid


# ---------------------------------------------------------------------------- the reply of a call
Decode = Callable[[list[int], dict], str]  # token ids -> text, as SGLang decodes under these sampling params


def sglang_reply(call: ModelCall, decode: Decode, *, routed_width: int, top_p: bool) -> dict:
    """SGLang's reply to a finished call, whatever its segments: the text decoded over every token
    (a stop string that a segment boundary hid from the engine is honoured here: the call is cut
    where one uninterrupted call would have stopped), log-probs and per-token weight versions of
    every segment, and what training replays when the function asked for it (``routed_width``: int32
    per routed-experts row, 0 when the job replays none; ``top_p``: the job replays top-p kept ids)."""
    t = call.trajectory
    params = call.request.sampling_params
    ids, finish, matched = list(t.response_ids), t.finish_reason, None
    if call.request.stop and t.num_calls > 1:
        cut = _first_stop(ids, call.request.stop, params, decode)
        if cut is not None:
            cut_at, matched = cut
            if cut_at < len(ids):
                t.truncate(cut_at)
                ids = list(t.response_ids)
            finish = "stop"
            t.finish_reason, t.status = "stop", TrajectoryStatus.COMPLETED
    text, matched = _reply_text(ids, finish, matched, call.request.stop, params, decode)
    finish_reason: dict[str, Any] = {"type": finish}
    if matched is not None:
        finish_reason["matched"] = matched
    elif finish == "length":
        finish_reason["length"] = len(ids)
    latest = t.version_runs.newest()
    if latest is None:
        latest = t.call_versions[-1] if t.call_versions else 0
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": t.uid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(t.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "output_token_logprobs": [[float(lp), int(i), None] for lp, i in zip(t.logprobs, ids)],
            "weight_version": str(latest),
            "weight_versions": t.version_runs.to_spans(),
            **(_top_p_fields(t) if top_p else {}),
            **_routed_fields(call, routed_width),
        },
    }


def _routed_fields(call: ModelCall, routed_width: int) -> dict:
    """The call's routed experts over every segment from the position the request named, as
    SGLang sends them (``return_routed_experts``); the trained sample's are the plugin's own
    (``core.served.served_routed``), whatever the function keeps."""
    start = call.request.routed_experts_from
    if start is None:
        return {}
    t = call.trajectory
    if not routed_width or t.replay is None or t.replay.routed is None:
        raise EpisodeError("return_routed_experts: this job's engines return no routed experts "
                           "(slime's --use-rollout-routing-replay is off)")
    rows = t.replay.routed_rows
    if start > rows:
        raise EpisodeError(f"routed_experts_start_len {start} is past the {rows} positions the call ran")
    raw = t.replay.routed_int32(start)  # int32, as SGLang sends them, whatever they are held as
    return {"routed_experts": base64.b64encode(raw).decode("ascii")}


def _top_p_fields(t: Trajectory) -> dict:
    """The call's top-p kept ids over every segment, as slime's SGLang patch sends them."""
    if t.replay is None or t.replay.top_p_counts is None:
        return {}
    return {"top_p_token_ids": base64.b64encode(bytes(t.replay.top_p_ids)).decode("ascii"),
            "top_p_token_offsets": base64.b64encode(int32_bytes(t.replay.top_p_offsets())).decode("ascii")}


def _reply_text(ids: list[int], finish: str, matched: str | None, stops: tuple[str, ...], params: dict,
                decode: Decode) -> tuple[str, str | int | None]:
    """A finished call's text and what its stop matched, as SGLang's detokenizer makes them
    (``trim_matched_stop``): the token that completes a stop string can carry text past it, which
    is cut (the string kept with ``no_stop_trim``, else cut too); a stop token (EOS, a stop token
    id: a "stop" that no stop string explains) is decoded only with ``no_stop_trim``. The output
    ids are not cut: SGLang returns every sampled token."""
    text = decode(ids, params)
    if finish != "stop" or not ids:
        return text, matched
    keep = bool(params.get("no_stop_trim", False))
    found = _earliest_stop(text, stops)
    if found:
        at, stop = found
        return (text[:at + len(stop)] if keep else text[:at]), stop
    return (text if keep else decode(ids[:-1], params)), ids[-1]


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the first stop string in ``text`` begins, and which one."""
    found = [(text.find(s), s) for s in stops if s and s in text]
    return min(found) if found else None


def _first_stop(ids: list[int], stops: tuple[str, ...], params: dict, decode: Decode) -> tuple[int, str] | None:
    """The shortest prefix of ``ids`` whose text holds a stop string (SGLang stops there when the
    call runs in one piece; a segment boundary can hide it from the engine)."""
    found = _earliest_stop(decode(ids, params), stops)
    if not found:
        return None
    stop = found[1]
    lo, hi = 1, len(ids)
    while lo < hi:  # prefix texts grow with the prefix, so "holds the stop" is monotone
        mid = (lo + hi) // 2
        if stop in decode(ids[:mid], params):
            hi = mid
        else:
            lo = mid + 1
    return lo, stop
