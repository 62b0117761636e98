"""slime's own multi-turn example functions, as the tests load them: unedited, from slime's examples
tarball (pinned commit, ``../shared/third_party/slime-examples/``, see ``_tarball``), with their
folder on ``sys.path`` so that their sibling imports work.

* ``examples/search-r1`` (``generate_with_search.generate``): text prompts, stop strings
  ``</search>`` / ``</answer>``, a retrieval between turns (``local_search_server`` posts to a
  ``/retrieve`` URL: ``RetrievalStub`` answers it on loopback);
* ``examples/retool`` (``generate_with_retool.generate``): token-id prompts built with its jinja2
  template, ``<code>`` run by its own ``tool_sandbox`` (a Python subprocess) between turns.

Only their module-level configuration is ever set (the retrieval URL, the number of passages,
the number of turns).
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support import ROOT


def _tarball() -> Path:
    """``APRIL_SLIME_EXAMPLES_TARBALL``, else ``shared/third_party/slime-examples/`` beside the
    repository or beside a folder holding it (a git worktree's)."""
    if os.environ.get("APRIL_SLIME_EXAMPLES_TARBALL"):
        return Path(os.environ["APRIL_SLIME_EXAMPLES_TARBALL"])
    relative = Path("shared", "third_party", "slime-examples", "slime-624b824a8-examples.tar.gz")
    candidates = [ROOT.parent / relative, ROOT.parent.parent / relative]
    return next((c for c in candidates if c.is_file()), candidates[0])


TARBALL = _tarball()
EXAMPLE_MODULES = ("generate_with_search", "qa_em_format", "local_search_server", "google_search_server",
                   "generate_with_retool", "tool_sandbox")
FOLDERS = {"generate_with_search": "search-r1", "generate_with_retool": "retool"}


AGENTS_TARBALL = TARBALL.with_name("slime-624b824a8-examples-agents.tar.gz")
AGENT_MODULES = ("generate_with_tau", "trainable_agents", "openai_tool_adapter", "sglang_tool_parser",
                 "token_delta", "examples", "examples.multi_agent", "examples.multi_agent.agent_system",
                 "examples.multi_agent.prompts", "examples.multi_agent.rollout_with_multi_agents")
MULTI_AGENT = "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"


def extract_agent_examples(root: Path) -> Path:
    """slime's ``examples/multi_agent`` and ``examples/tau-bench``, extracted unedited under
    ``root``; returns the folder holding ``examples/`` (multi_agent loads its agents by the path
    ``examples.multi_agent...``, so that folder goes on ``sys.path``)."""
    if not AGENTS_TARBALL.is_file():
        raise FileNotFoundError(f"slime's agent examples tarball is not at {AGENTS_TARBALL}")
    with tarfile.open(AGENTS_TARBALL) as tar:
        tar.extractall(root, filter="data")
    (folder,) = root.glob("*/examples")
    return folder.parent


async def batch_reward(args, samples, **kwargs):
    """A reward for ``--custom-rm-path`` called as slime calls it, per sample or batched (multi_agent
    rewards its agents' samples with ``batched_async_rm``): 1.0 for an even response length."""
    if isinstance(samples, list):
        return [float(s.response_length % 2 == 0) for s in samples]
    return float(samples.response_length % 2 == 0)


def extract_examples(root: Path) -> Path:
    """slime's ``examples/`` folder (search-r1 and retool only), extracted unedited under ``root``."""
    if not TARBALL.is_file():
        raise FileNotFoundError(f"slime's examples tarball is not at {TARBALL} (set APRIL_SLIME_EXAMPLES_TARBALL)")
    wanted = ("/examples/search-r1/", "/examples/retool/")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(root, members=[m for m in tar.getmembers() if any(w in f"/{m.name}" for w in wanted)],
                       filter="data")
    (folder,) = root.glob("*/examples")
    return folder


def import_examples(folder: Path) -> dict[str, object]:
    """Both example functions' modules, imported fresh (their module-level configuration and
    semaphores are their own); ``forget_examples`` takes them out of ``sys.modules`` again."""
    import importlib

    forget_examples()
    for sub in FOLDERS.values():
        if str(folder / sub) not in sys.path:
            sys.path.insert(0, str(folder / sub))
    return {name: importlib.import_module(name) for name in FOLDERS}


def forget_examples(folder: Path | None = None) -> None:
    """The example modules out of ``sys.modules`` (and ``folder`` off ``sys.path``); slime's
    ``load_function`` forgets what it loaded too, since it caches by path: a later job would
    otherwise call the functions of modules imported before, with their configuration."""
    for name in EXAMPLE_MODULES:
        sys.modules.pop(name, None)
    try:
        from slime.utils.misc import load_function
    except ImportError:  # no slime: nothing was loaded through it
        pass
    else:
        getattr(load_function, "cache_clear", lambda: None)()  # slime_standin's does not cache
    if folder is not None:
        for sub in FOLDERS.values():
            while str(folder / sub) in sys.path:
                sys.path.remove(str(folder / sub))


class RetrievalStub:
    """A local retrieval server (``POST /retrieve``) answering as Search-R1's ``retrieval_server.py``
    does with ``return_scores`` false: ``{"result": [[{"id", "contents"}, ...] per query]}``, the
    passage ``contents(query, k)``. It runs on a thread of its own (any event loop may call it) and
    records every query it answered."""

    def __init__(self, port: int = 0) -> None:
        self.queries: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.queries += body["queries"]
                docs = [[{"id": str(k), "contents": stub.contents(q, k)} for k in range(body["topk"])]
                        for q in body["queries"]]
                raw = json.dumps({"result": docs}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def contents(query: str, k: int) -> str:
        """Passage ``k`` for ``query``: a title line, then its text (the retrieval corpus' format)."""
        return f'"Doc {k}"\ntext about {query}'

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of every maximal run of equal loss-mask values: a multi-turn sample's model
    turns (1) and the observations between them (0)."""
    runs: list[tuple[int, int, int]] = []
    for k, m in enumerate(mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], k + 1)
        else:
            runs.append((m, k, k + 1))
    return runs
