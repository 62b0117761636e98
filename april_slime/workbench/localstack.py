"""A real, local rollout stack: a tiny model, SGLang CPU engines, and the sglang-router in front.

What slime jobs run (SGLang engines behind ``sglang-router``), shrunk to one machine without a GPU
and without network: the real test tier, ``april-slime demo`` and the calibration tests build on it.

    build_tiny_qwen3(dir)                     # random Qwen3 + a locally trained tokenizer
    with local_stack(dir, n_engines=2) as s:  # engines + router on free loopback ports
        s.router_url, s.engine_urls

From a shell (for people; stops everything on Ctrl-C)::

    python -m april_slime.localstack --tiny /tmp/tiny --engines 2

Engines run SGLang 0.5.23 on CPU (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu --attention-backend
torch_native --sampling-backend pytorch --disable-cuda-graph --dtype float32``), which needs the
environment ``scripts/real-stack/setup.sh`` builds; ``real_stack_missing()`` says what is absent.
Every server binds a port chosen at run time and runs in its own process group, which ``stop()``
(or leaving the ``with`` block) kills whole.

Only the standard library is imported at module level; transformers / tokenizers / torch are
imported by ``build_tiny_qwen3`` when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = [
    "LocalEngine",
    "LocalRouter",
    "LocalStack",
    "ServerStartError",
    "build_tiny_qwen3",
    "local_stack",
    "SlimeRolloutManager",
    "real_stack_missing",
    "slime_args",
    "tiny_corpus",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The flags that make SGLang 0.5.23 serve on CPU from PyPI wheels (see scripts/real-stack/README.md).
CPU_ENGINE_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--disable-cuda-graph", "--dtype", "float32")


# ====================================================================== environment check
def real_stack_missing() -> str | None:
    """None when SGLang, the router and the CPU workarounds are in this environment, else one line
    saying what is missing and how to get it."""
    fix = "run `bash scripts/real-stack/setup.sh` and use its .venv"
    for module, what in (("sglang", "SGLang"), ("sglang_router", "sglang-router"),
                         ("transformers", "transformers"), ("torch", "torch")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed ({module} not importable); {fix}"
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return f"sgl_kernel is missing (SGLang imports CPU helpers from it); {fix}"
    if "assign_req_to_token_pool_cpu" not in Path(spec.origin).read_text(encoding="utf-8", errors="replace"):
        return f"{spec.origin} lacks the CPU helpers SGLang needs (assign_req_to_token_pool_cpu); {fix}"
    tv = importlib.util.find_spec("torchvision")
    if tv is not None and tv.submodule_search_locations:
        meta = Path(list(tv.submodule_search_locations)[0]) / "_meta_registrations.py"
        if meta.exists() and '@torch.library.register_fake("torchvision::nms")\n' in meta.read_text(encoding="utf-8"):
            return f"torchvision's nms fake registration is unguarded ({meta}), so SGLang cannot import; {fix}"
    return None


# ====================================================================== tiny model
def tiny_corpus(n: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic short texts (arithmetic questions and answers, number words) to train the
    tokenizer on: enough distinct strings for a 2K-token BPE vocabulary."""
    import random

    rng = random.Random(seed)
    words = ("zero one two three four five six seven eight nine ten eleven twelve plus minus times "
             "equals answer question what is the sum of and product difference between number "
             "result think step first then finally so therefore because check again box").split()
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        texts.append(f"Question: what is {a} {op} {b}? {phrase}. Answer: \\boxed{{{value}}}")
    return texts


def build_tiny_qwen3(out_dir: str | os.PathLike, *, texts: Sequence[str] | None = None, tokenizer: Any = None,
                     vocab_size: int = 2048, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0,
                     eos_rate: float | None = None) -> Path:
    """Save a random Qwen3 and its tokenizer to ``out_dir`` (``save_pretrained``); no hub access.

    The tokenizer is ``tokenizer`` when given, else a byte-level BPE trained here on ``texts``
    (default ``tiny_corpus()``) up to ``vocab_size`` tokens, with Qwen's special tokens and EOS
    ``<|im_end|>``. The model's vocabulary is the tokenizer's size, so every id it samples decodes.

    ``eos_rate``: when set, the weights are shaped so that sampling at temperature 1 ends a response
    with about this probability per token (lengths spread geometrically: a long tail under a
    budget); the other tokens' logits get a standard deviation of 2 so the distribution is not flat.
    Unset, EOS is as likely as any token (about 1/vocab) and nearly every response runs to its
    budget. Deterministic for a given ``seed``.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = _train_tokenizer(list(texts) if texts is not None else tiny_corpus(seed=seed), vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    if eos_rate is not None:
        if not 0.0 < eos_rate < 1.0:
            raise ValueError(f"eos_rate must lie in (0, 1), got {eos_rate}")
        _shape_eos(model, eos_id, eos_rate, seed)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ValueError("texts is empty: the tokenizer needs something to train on")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _shape_eos(model: Any, eos_id: int, eos_rate: float, seed: int) -> None:
    """Make hidden dimension 0 a constant the layers never write (embedding column 0 constant,
    row 0 of every attention / MLP output projection zero), read only by the EOS row of the
    untied LM head. The EOS logit is then ``w * h0`` with ``h0`` (dimension 0 after the final RMS
    norm) nearly constant, and ``w`` is solved so the mean EOS probability over random contexts is
    ``eos_rate``."""
    import torch

    inner = model.model
    with torch.no_grad():
        emb = inner.embed_tokens.weight
        emb[:, 0] = emb[:, 1:].norm(dim=1).mean()
        for layer in inner.layers:
            layer.self_attn.o_proj.weight[0, :] = 0
            layer.mlp.down_proj.weight[0, :] = 0
        head = model.lm_head.weight
        head[:, 0] = 0
        head[eos_id] = 0
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, emb.shape[0], (8, 64), generator=g)
        h = inner(input_ids=ids).last_hidden_state.reshape(-1, emb.shape[1])
        logits = h @ head.T
        others = torch.ones(emb.shape[0], dtype=torch.bool)
        others[eos_id] = False
        head[others] *= 2.0 / logits[:, others].std()
        log_z = torch.logsumexp((h @ head.T)[:, others], dim=1)
        h0 = h[:, 0]

        def rate(w: float) -> float:
            return float(torch.sigmoid(w * h0 - log_z).mean())

        lo, hi = 0.0, 1.0
        while rate(hi) < eos_rate:
            hi *= 2.0
            if hi > 1e6:
                raise RuntimeError("cannot reach the requested eos_rate")
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(mid) < eos_rate else (lo, mid)
        head[eos_id, 0] = (lo + hi) / 2


# ====================================================================== servers
class ServerStartError(RuntimeError):
    """A server process died or did not answer in time; the message carries its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read() or b"null")


def _tail(path: Path | None, n: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


@dataclass
class _Process:
    """One server command in its own process group, logging to a file."""

    name: str
    log_path: Path | None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    _own_log: bool = False

    def launch(self, cmd: list[str]) -> None:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"april-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path, self._own_log = Path(name), True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)

    def wait_ready(self, probe, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None:
                raise ServerStartError(f"{self.name}: not launched")
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"{self.name} exited with code {code} before {what}; log "
                                       f"{self.log_path}:\n{_tail(self.log_path)}")
            try:
                if probe():
                    return
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name}: no {what} within {timeout_s:.0f} s; log "
                                       f"{self.log_path}:\n{_tail(self.log_path)}")
            time.sleep(0.5)

    def address_in_use(self) -> bool:
        text = _tail(self.log_path, 200)
        return "address already in use" in text.lower() or "errno 98" in text.lower()

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # the leader is gone; children of the group may linger a moment longer
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if self._own_log and self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


class LocalEngine:
    """One SGLang 0.5.23 CPU engine serving ``model_path`` in a subprocess.

    ``port=None`` picks a free port at start (and another one if it was taken meanwhile).
    ``threads`` sets OMP_NUM_THREADS for the engine (1 by default: the machines it is meant for
    are small and shared). ``extra_args`` go to ``sglang.launch_server`` as they are.
    """

    def __init__(self, model_path: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1",
                 max_total_tokens: int = 32768, max_running_requests: int = 64, weight_version: int | str = 0,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None, threads: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.model_path = str(model_path)
        self.host = host
        self._fixed_port = port
        self.port = port
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.weight_version = str(weight_version)
        self.extra_args = list(extra_args)
        self._process = _Process("sglang-engine", Path(log_path) if log_path else None,
                                 env={"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(threads),
                                      "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                                      **(env or {})})

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("engine not started: no port yet")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._process.log_path

    @property
    def pid(self) -> int | None:
        return self._process.proc.pid if self._process.proc else None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port), *CPU_ENGINE_FLAGS,
                "--max-total-tokens", str(self.max_total_tokens),
                "--max-running-requests", str(self.max_running_requests),
                "--weight-version", self.weight_version, "--skip-server-warmup", *self.extra_args]

    def launch(self) -> "LocalEngine":
        """Start the process without waiting (``wait_ready`` waits); lets several engines boot at once."""
        if self.port is None or self._fixed_port is None:
            self.port = free_port(self.host)
        self._process.launch(self.command())
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> "LocalEngine":
        for attempt in range(3):
            try:
                self._process.wait_ready(lambda: _get_json(f"{self.url}/model_info") is not None, timeout_s,
                                         "reply on /model_info")
                return self
            except ServerStartError:
                if self._fixed_port is not None or attempt == 2 or not self._process.address_in_use():
                    raise
                self._process.stop()
                self.launch()
        return self

    def start(self, timeout_s: float = 600.0) -> "LocalEngine":
        return self.launch().wait_ready(timeout_s)

    def stop(self) -> None:
        self._process.stop()

    def __enter__(self) -> "LocalEngine":
        return self.start() if self._process.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LocalRouter:
    """sglang-router (the Rust router slime launches) in front of ``worker_urls``, with the settings
    slime gives it: no circuit breaker, no health checks of its own."""

    def __init__(self, worker_urls: Sequence[str], *, port: int | None = None, host: str = "127.0.0.1",
                 policy: str | None = None, extra_args: Sequence[str] = (),
                 log_path: str | os.PathLike | None = None) -> None:
        if not worker_urls:
            raise ValueError("LocalRouter needs at least one worker URL")
        self.worker_urls = list(worker_urls)
        self.host = host
        self._fixed_port = port
        self.port = port
        self.policy = policy
        self.extra_args = list(extra_args)
        self._process = _Process("sglang-router", Path(log_path) if log_path else None)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("router not started: no port yet")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._process.log_path

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.worker_urls,
               "--host", self.host, "--port", str(self.port), "--prometheus-host", self.host,
               "--prometheus-port", str(free_port(self.host)), "--disable-circuit-breaker",
               "--disable-health-check"]
        if self.policy:
            cmd += ["--policy", self.policy]
        return cmd + self.extra_args

    def _serves_all_workers(self) -> bool:
        listed = {w.get("url") for w in _get_json(f"{self.url}/workers").get("workers", [])}
        return set(self.worker_urls) <= listed

    def start(self, timeout_s: float = 600.0) -> "LocalRouter":
        # The deadline only guards against a hang, like the engines': on a starved machine the
        # router's start-up alone (a Python launcher, then the Rust server) has taken over 120 s.
        for attempt in range(3):
            if self.port is None or self._fixed_port is None:
                self.port = free_port(self.host)
            self._process.launch(self.command())
            try:
                self._process.wait_ready(self._serves_all_workers, timeout_s, "list of its workers on /workers")
                return self
            except ServerStartError:
                if self._fixed_port is not None or attempt == 2 or not self._process.address_in_use():
                    raise
                self._process.stop()
        return self

    def stop(self) -> None:
        self._process.stop()

    def __enter__(self) -> "LocalRouter":
        return self.start() if self._process.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class LocalStack:
    router_url: str
    engine_urls: list[str]
    engines: list[LocalEngine]
    router: LocalRouter


@contextlib.contextmanager
def local_stack(model_path: str | os.PathLike, n_engines: int = 1, *, router_kwargs: dict | None = None,
                start_timeout_s: float = 600.0, log_dir: str | os.PathLike | None = None,
                **engine_kwargs: Any) -> Iterator[LocalStack]:
    """``n_engines`` CPU engines (booted concurrently) behind one router; all stopped on exit.
    ``engine_kwargs`` go to every ``LocalEngine``. With ``log_dir``, the servers log to
    ``engine-<i>.log`` and ``router.log`` there (kept); else to temporary files removed on stop."""
    if n_engines < 1:
        raise ValueError(f"n_engines must be >= 1, got {n_engines}")
    logs = Path(log_dir) if log_dir is not None else None
    engines = [LocalEngine(model_path, log_path=logs / f"engine-{i}.log" if logs else None, **engine_kwargs)
               for i in range(n_engines)]
    router_kwargs = dict(router_kwargs or {})
    if logs:
        router_kwargs.setdefault("log_path", logs / "router.log")
    router = None
    try:
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.wait_ready(start_timeout_s)
        router = LocalRouter([e.url for e in engines], **router_kwargs).start()
        yield LocalStack(router.url, [e.url for e in engines], engines, router)
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


# ====================================================================== slime on the local stack
def slime_args(argv: list[str], **overrides: Any) -> argparse.Namespace:
    """Arguments as slime's own parser builds them (its rollout + SGLang/router groups; the
    Megatron training groups are not needed on the rollout side), then ``overrides``, then slime's
    own validation (derived defaults: eval function, over-sampling size, ``--custom-config-path``)."""
    from slime.backends.sglang_utils.arguments import add_sglang_arguments
    from slime.utils.arguments import get_slime_extra_args_provider, slime_validate_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    get_slime_extra_args_provider()(parser)
    add_sglang_arguments(parser)
    # the mode flags slime's parse_args reads in a pre-pass
    parser.add_argument("--train-backend", default="megatron")
    parser.add_argument("--debug-rollout-only", action="store_true")
    parser.add_argument("--debug-train-only", action="store_true")
    parser.add_argument("--load-debug-rollout-data", default=None)
    args = parser.parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    slime_validate_args(args)  # slime's own derived defaults (eval path, over-sampling, custom config)
    return args


class SlimeRolloutManager:
    """slime's own ``RolloutManager`` methods (unwrapped from the Ray actor class) on an instance
    built like its ``__init__`` minus Ray and engine start-up: the engines are ``real_stack``'s.

    ``generate`` does what ``RolloutManager.generate`` does up to the DP split (which needs Ray):
    ``call_rollout_fn`` on ``--rollout-function-path`` with the data source of
    ``--data-source-path``, slime's rollout logging, and the conversion to train data (which
    checks the sample contract: loss-mask lengths, rewards, rollout log-probs)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from slime.ray.rollout import RolloutManager
        from slime.utils.misc import load_function

        from slime.utils.http_utils import init_http_client

        from slime.rollout.sglang_rollout import GenerateState

        init_http_client(args)  # slime's HTTP client to the router, as RolloutManager.__init__ makes it
        # slime builds its rollout state (tokenizer, sampling parameters, semaphore) once per
        # process, from the first job's arguments. A manager here stands for a job process of its
        # own, so it must not inherit another job's: another model's tokenizer, say.
        GenerateState._instances.pop(GenerateState, None)
        raw = RolloutManager.__ray_metadata__.modified_class.__mro__[1]
        assert raw.__name__ == "RolloutManager", raw
        self.cls = raw
        self.manager = m = object.__new__(raw)
        m.pg, m.args, m.servers = None, args, {}
        m.data_source = load_function(args.data_source_path)(args)
        m.generate_rollout = load_function(args.rollout_function_path)
        m.eval_generate_rollout = load_function(args.eval_function_path)
        m.custom_reward_post_process_func = None
        m.custom_convert_samples_to_train_data_func = None
        m.rollout_id = -1
        m._health_monitors = []

    @property
    def data_source(self) -> Any:
        return self.manager.data_source

    def generate(self, rollout_id: int) -> tuple[list[Any], dict, dict]:
        """(flattened samples, rollout metrics, train data) of one rollout step."""
        from slime.observability.rollout_metrics import log_rollout_data

        m = self.manager
        start = time.time()
        m.rollout_id = rollout_id
        samples, metrics = self.cls._get_rollout_data(m, rollout_id=rollout_id)
        log_rollout_data(rollout_id, m.args, samples, metrics, time.time() - start)
        train = self.cls._convert_samples_to_train_data(m, samples)
        return samples, metrics or {}, train

    def eval(self, rollout_id: int) -> None:
        self.cls.eval(self.manager, rollout_id)

    def save(self, rollout_id: int) -> None:
        self.cls.save(self.manager, rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.cls.load(self.manager, rollout_id)


# ====================================================================== command line
def main(argv: Sequence[str] | None = None, prog: str = "python -m april_slime.localstack") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model on local SGLang CPU engines behind sglang-router until interrupted.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local Hugging Face model folder")
    src.add_argument("--tiny", metavar="DIR", help="build a tiny random Qwen3 in DIR (reused if present) and serve it")
    parser.add_argument("--eos-rate", type=float, default=None,
                        help="with --tiny: per-token EOS probability shaped into the weights")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    parser.add_argument("--no-router", action="store_true", help="engines only")
    parser.add_argument("--log-dir", type=Path, default=None)
    ns = parser.parse_args(argv)
    missing = real_stack_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    model = ns.model
    if ns.tiny:
        model = Path(ns.tiny)
        if not (model / "config.json").exists():
            print(f"building a tiny Qwen3 in {model}", file=sys.stderr)
            build_tiny_qwen3(model, eos_rate=ns.eos_rate)
    logs = (lambda name: ns.log_dir / name) if ns.log_dir else (lambda name: None)
    engine_kw = dict(max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running_requests,
                     threads=ns.threads)
    stop = {"now": False}

    def on_signal(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    with contextlib.ExitStack() as stack:
        engines = [LocalEngine(model, log_path=logs(f"engine-{i}.log"), **engine_kw) for i in range(ns.engines)]
        for e in engines:
            stack.callback(e.stop)
            e.launch()
        for e in engines:
            e.wait_ready()
            print(f"engine: {e.url}  (log {e.log_path})", flush=True)
        if not ns.no_router:
            router = LocalRouter([e.url for e in engines], log_path=logs("router.log"))
            stack.callback(router.stop)
            router.start()
            print(f"router: {router.url}  (log {router.log_path})", flush=True)
        print("serving; Ctrl-C stops everything", flush=True)
        try:
            while not stop["now"]:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
