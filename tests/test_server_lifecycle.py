"""No process of a server the project starts outlives the command that started it: the supervisor
(launcher/serving/supervisor.py) takes the whole tree along on SIGKILL, SIGTERM and SIGINT of the
command, and when the server dies on its own; SIGTERM and SIGINT say what is kept and how to resume.

The first tests stand a shell script in for vLLM's python (a tree of `sleep`s, one of them escaped
into a session of its own, as a daemon would); the last one runs `launcher.regenerate
regenerate.engine=vllm` with a real `vllm serve` (make vllm-env) four times side by side, one per
way of ending, so the servers load once together."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.serving.supervisor import READY_WORDS, descendants, is_ready_line
from launcher.serving.vllm_server import SERVER_MODULE, ServerError, VllmServer, log_excerpt
from tests import served
from tests.launching import REPO, wait_for

# How long a process of a stopped tree may take to be gone: the supervisor's SIGTERM grace (2 s for
# the stand-ins, 30 s for vLLM), its SIGKILL pass, and a loaded 2-core machine; a killed process goes
# within milliseconds.
GONE_WITHIN_S = 60.0

# A server's stand-in: a child in its process group, a grandchild that leaves the group and its
# parent (setsid, as a daemon does; adopted by the supervisor), an error far above the log's end.
FAKE_SERVER = """#!/bin/sh
sleep 300 &
(setsid sleep 301 &)
echo "ValueError: the root cause, far above the end"
i=0; while [ $i -lt 60 ]; do echo "shutting down $i"; i=$((i+1)); done
exec sleep 302
"""


def _fake_python(tmp_path: Path, body: str = FAKE_SERVER) -> str:
    script = tmp_path / "python"
    script.write_text(body)
    script.chmod(0o755)
    return str(script)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of a live (not zombie) process: a pid the system reused is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def server_tree(supervisor: int) -> dict[int, str]:
    """pid -> start time of the supervisor and every process below it."""
    return {pid: start for pid in [supervisor, *descendants(supervisor)] if (start := _start_time(pid))}


def still_alive(tree: dict[int, str], within_s: float = GONE_WITHIN_S) -> list[str]:
    """The processes of `tree` still alive after waiting up to within_s for them to go (their command lines)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid, start in tree.items() if _start_time(pid) == start]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [f"{pid}: {_command_line(pid)}" for pid in alive]


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _process_named(root: int, name: str, deadline_s: float = 60.0) -> int:
    """The process below `root` whose command line holds `name` (the supervisor's holds the server's), once there."""
    deadline = time.monotonic() + deadline_s
    while not (found := [pid for pid in descendants(root) if name in _command_line(pid)]):
        assert time.monotonic() < deadline, f"no {name!r} below pid {root} within {deadline_s:.0f} s"
        time.sleep(0.2)
    return found[0]


def _supervisor_of(command: int) -> int:
    return _process_named(command, "launcher.serving.supervisor")


def complete_tree(supervisor: int, needed: tuple[str, ...], deadline_s: float = 60.0) -> dict[int, str]:
    """The server's tree once a process of each `needed` command line is in it (before, a shell's
    short-lived forks come and go): those processes and the supervisor, pid -> start time."""
    for name in needed:
        _process_named(supervisor, name, deadline_s)
    tree = server_tree(supervisor)
    return {pid: start for pid, start in tree.items()
            if pid == supervisor or any(name in _command_line(pid) for name in needed)}


SLEEPS = ("sleep 300", "sleep 301", "sleep 302")   # FAKE_SERVER's


# ----------------------------------------------------------------------------- with a stand-in server
_COMMAND = """
import sys, time
from launcher.serving.vllm_server import VllmServer
server = VllmServer("/nonexistent", python=sys.argv[1], stop_grace_s=float(sys.argv[2]))
server.launch()
print(server.log_path, flush=True)
time.sleep(600)
"""


def test_sigkill_of_the_command_takes_the_whole_tree_and_the_temporary_log(tmp_path):
    command = subprocess.Popen([sys.executable, "-c", _COMMAND, _fake_python(tmp_path), "2"], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)
    try:
        log = Path(command.stdout.readline().strip())
        tree = complete_tree(_supervisor_of(command.pid), SLEEPS)
    finally:
        command.kill()
        command.wait()
    assert not still_alive(tree)
    assert not log.exists(), "the temporary log of a server whose command died is left behind"


# vLLM starting up (loading, compiling) leaves SIGTERM unanswered: a stand-in whose every process ignores it
# (an ignored signal stays ignored across exec).
STARTING_SERVER = FAKE_SERVER.replace("#!/bin/sh\n", "#!/bin/sh\ntrap '' TERM\n")
# How long the tree of a server that was not ready may outlive its command: the supervisor's start-up grace
# (2 s), its SIGKILL pass (milliseconds) and a loaded 2-core machine's delays; a third of the 30 s grace of
# the server below, which a server with nothing to drain must not be given.
GONE_BEFORE_READY_WITHIN_S = 10.0


def test_sigkill_of_the_command_while_the_server_starts_takes_the_tree_at_once(tmp_path):
    """Issue 46: SIGKILL of a command during vLLM's start-up left its API server, resource tracker and
    a defunct engine core for the whole 30 s grace, with nothing to drain."""
    command = subprocess.Popen([sys.executable, "-c", _COMMAND, _fake_python(tmp_path, STARTING_SERVER), "30"],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        command.stdout.readline()
        tree = complete_tree(_supervisor_of(command.pid), SLEEPS)
    finally:
        command.kill()
        command.wait()
    assert not still_alive(tree, within_s=GONE_BEFORE_READY_WITHIN_S)


# A server that becomes ready, logging on its way an error of vLLM's start-up compile that vLLM survives, and
# dies (SIGKILL) when asked for its /metrics, saying why first.
_READY_SERVER = """
import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            print("RuntimeError: what the server said before it died", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.send_response(200)
        self.end_headers()
print("AssertionError: Please convert all Tensors to FakeTensors first", flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def _said_ready(server: VllmServer) -> None:
    wait_for(lambda: any(map(is_ready_line, server.log_path.read_text().splitlines())), 30,
             "the supervisor's line saying the server is ready")


def test_a_request_failing_because_the_server_died_says_so_at_once_with_what_it_said_after_start_up(tmp_path):
    """Issue 46: after the supervisor had said the server was dead, the client retried for 31 s; the
    death's excerpt showed an error of vLLM's start-up that did not stop it."""
    from launcher.serving.openai_client import ServerDown

    fake = _fake_python(tmp_path, f"#!{sys.executable}\n{_READY_SERVER}")
    with pytest.raises(ServerError, match=r"(?s)the vllm serve this command started .* died with exit code 137 "
                                          r"\(killed by SIGKILL\).*what the server said before it died") as failure:
        server = VllmServer(tmp_path, python=fake, stop_grace_s=2)
        with server as client:   # it retries a failed request 5 times, after 1, 2, 4, 8 and 16 s
            _said_ready(server)
            asking = time.monotonic()
            client.metrics()
    # Retried, a dead server is given up after 31 s; known dead, after at most one wait of 1 s (its
    # supervisor had not yet said so at the first failure) and the teardown of a tree with nothing left.
    assert time.monotonic() - asking < 15
    assert isinstance(failure.value.__cause__, ServerDown)
    assert "not retried, the server is dead: [supervisor" in str(failure.value.__cause__)
    assert "FakeTensors" not in str(failure.value)
    log = Path(str(failure.value).split("its log ", 1)[1].split(" that matter", 1)[0])
    assert log.is_file(), "the log the error names is gone"
    log.unlink()


def test_a_ready_server_is_given_its_grace_and_the_log_says_when_it_became_ready(tmp_path):
    """Once ready, a server has requests to drain: stopped, its processes have the whole grace."""
    ignoring_sigterm = f"#!{sys.executable}\nimport signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    grace_s = 6.0   # above the start-up grace, which a ready server must not get
    server = VllmServer(tmp_path, python=_fake_python(tmp_path, ignoring_sigterm + _READY_SERVER),
                        log_path=tmp_path / "log", stop_grace_s=grace_s)
    server.launch()
    try:
        server.wait_ready()
        _said_ready(server)
    finally:
        stopping = time.monotonic()
        server.stop()
    assert time.monotonic() - stopping >= grace_s


def test_a_server_that_dies_on_its_own_is_named_with_its_log_and_leaves_nothing(tmp_path):
    server = VllmServer(tmp_path, python=_fake_python(tmp_path), stop_grace_s=2)
    server.launch()
    try:
        tree = complete_tree(server.process.pid, SLEEPS)
        os.kill(_process_named(server.process.pid, SLEEPS[2]), signal.SIGKILL)   # the server, not what it started
        died = server.died()
        assert not still_alive(tree)
    finally:
        server.stop()
    assert died is not None and "died with exit code 137 (killed by SIGKILL)" in died
    assert f"its log {server.log_path} that matter" in died and "ValueError: the root cause" in died
    assert server.log_path.exists(), "the log an error names is removed"


def test_stop_kills_the_group_when_its_leader_is_gone(tmp_path):
    server = VllmServer(tmp_path, python=_fake_python(tmp_path), log_path=tmp_path / "log", stop_grace_s=2)
    server.launch()
    tree = complete_tree(server.process.pid, SLEEPS)
    escaped = [pid for pid in tree if os.getsid(pid) != server.process.pid]   # out of the group: not stop()'s
    os.kill(server.process.pid, signal.SIGKILL)   # the supervisor, killed before it could stop anything
    server.process.wait()
    try:
        time.sleep(1.0)   # the server goes with the supervisor (its parent-death signal); what it started stays
        group = {pid: start for pid, start in tree.items() if pid not in escaped and _start_time(pid) == start}
        assert group, "nothing of the group outlived its leader: nothing to test"
        server.stop()
        assert not still_alive(group)
    finally:
        for pid in escaped:
            os.kill(pid, signal.SIGKILL)


def test_a_server_stopped_by_this_process_leaves_nothing_and_removes_its_temporary_log(tmp_path):
    server = VllmServer(tmp_path, python=_fake_python(tmp_path), stop_grace_s=2)
    server.launch()
    tree = complete_tree(server.process.pid, SLEEPS)
    server.stop()
    assert not still_alive(tree, within_s=0)   # stop() returns once they are gone
    assert server.died() is None and not server.log_path.exists()


def test_the_log_excerpt_keeps_the_root_cause_far_above_the_end_and_not_the_teardowns_noise():
    worker = "(Worker pid=7) ERROR 12-05 08:24:29 [executor.py:953] "
    core = "(EngineCore pid=6) ERROR 12-05 08:24:34 [core.py:1510] "
    log = ["(APIServer pid=5) INFO 12-05 08:23:42 [api_server.py:1] loading"] * 5 + [
        f"{worker}WorkerProc failed to start.",
        f"{worker}Traceback (most recent call last):",
        f'{worker}  File "/v/weight_utils.py", line 1208, in safetensors_weights_iterator',
        f'{worker}    with safe_open(st_file, framework="pt") as f:',
        f"{worker}         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        f"{worker}safetensors._safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata",
        *(f"{core}  File \"/v/core.py\", line {k}, in f{k}" for k in range(100)),
        f"{core}Exception: WorkerProc initialization failed due to an exception in a background process.",
        "RuntimeError: Engine core initialization failed. See root cause above.",
        "[supervisor 9] the server (pid 10) exited with code 1; stopping the processes it left",
        *(f"{core}RuntimeError: cancelled {k}" for k in range(30)),   # the teardown's own
    ]
    excerpt = log_excerpt("\n".join(log))
    assert [line for line in excerpt.splitlines() if "SafetensorError" in line or "weight_utils" in line] == \
        [log[7], log[10]], "the root cause with the frame it was raised in"
    assert log[5] in excerpt and log[-31] in excerpt and excerpt.endswith(log[-31])
    assert "cancelled" not in excerpt and "line 50," not in excerpt


def test_the_log_excerpt_of_a_server_that_became_ready_leaves_out_its_start_up_errors():
    """Issue 46: a served run's death excerpt showed an error vLLM's start-up compile logs and survives."""
    core = "(EngineCore pid=6) ERROR 12-05 08:24:34 [core.py:1510] "
    log = ["(EngineCore pid=6) WARNING 12-05 08:23:50 [backends.py:1] compile failed, falling back",
           "Traceback (most recent call last):", '  File "/t/fake_tensor.py", line 2, in from_real_tensor',
           "AssertionError: Please convert all Tensors to FakeTensors first",
           "(APIServer pid=5) INFO 12-05 08:24:01 [launcher.py:1] Application startup complete.",
           f"[supervisor 9] {READY_WORDS}: stopping it now gives its processes 30 s to exit before SIGKILL",
           *["(APIServer pid=5) INFO 12-05 08:24:02 [h11.py:1] POST /v1/chat/completions 200 OK"] * 20,
           f'{core}  File "/v/core.py", line 7, in step', f"{core}RuntimeError: the engine core died mid-step",
           *["(APIServer pid=5) INFO 12-05 08:24:35 [h11.py:1] POST /v1/chat/completions 500"] * 10,
           "[supervisor 9] the server (pid 10) exited with code 1; stopping the processes it left"]
    excerpt = log_excerpt("\n".join(log))
    assert "FakeTensors" not in excerpt and "fake_tensor.py" not in excerpt, excerpt
    assert f"{log[26]}\n{log[27]}" in excerpt and log[5] in excerpt and excerpt.endswith(log[-1]), excerpt


def test_a_failed_server_start_names_its_log_and_leaves_no_parts(tmp_path, tiny_target_dir):
    from dflash_core.target.tiny import BUNDLED_DATASET
    from launcher.regenerate import run

    fake = _fake_python(tmp_path, '#!/bin/sh\necho "ValueError: no DFlash for this model"\n'
                                  'i=0; while [ $i -lt 60 ]; do echo "noise $i"; i=$((i+1)); done; exit 2\n')
    output = tmp_path / "out" / "regen.jsonl"
    with pytest.raises(ServerError, match=r"(?s)exited before it was ready \(exit code 2; log (\S+)\).*"
                                          r"ValueError: no DFlash for this model") as failure:
        run([f"target.path={tiny_target_dir}", f"regenerate.input={BUNDLED_DATASET}", f"regenerate.output={output}",
             "regenerate.engine=vllm", f"regenerate.vllm_python={fake}", "regenerate.limit=2"])
    log = Path(str(failure.value).split("; log ", 1)[1].split(")", 1)[0])
    try:
        assert log.is_file(), "the log the error names is gone"
    finally:
        log.unlink(missing_ok=True)
    assert not output.with_name(output.name + ".parts").exists() and not output.exists()


# ----------------------------------------------------------------------------- a real vLLM server
ENDINGS = ("SIGKILL", "SIGTERM", "SIGINT", "server died")


def _regenerate(target: Path, root: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """launcher.regenerate regenerate.engine=vllm of more prompts than it can answer before the test
    stops it, one conversation at a time; its output goes to root/name.err."""
    from dflash_core.target.tiny import BUNDLED_DATASET
    output = root / f"{name}.jsonl"
    err = open(root / f"{name}.err", "w")
    command = subprocess.Popen(
        [sys.executable, "-m", "launcher.regenerate", f"target.path={target}", f"regenerate.input={BUNDLED_DATASET}",
         f"regenerate.output={output}", "regenerate.engine=vllm", "regenerate.max_new_tokens=64",
         "regenerate.device=cpu", "regenerate.concurrency=1", "regenerate.max_retries=1",
         "regenerate.retry_backoff_s=0.1", f"regenerate.vllm_args=[{','.join(served.SERVER_ARGS)}]"],
        cwd=REPO, stdout=err, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    err.close()
    return command, output


def _answered(output: Path) -> int:
    part = output.with_name(output.name + ".parts") / "rank00000.jsonl"
    return len(part.read_text().splitlines()) if part.exists() else 0


@pytest.mark.xdist_group("vllm")
@pytest.mark.timeout(1800)
def test_no_process_of_a_started_vllm_server_outlives_regenerate(tiny_target_dir, tmp_path):
    served.require_vllm_env()
    runs = {ending: _regenerate(tiny_target_dir, tmp_path, ending.replace(" ", "_")) for ending in ENDINGS}
    try:
        _end_each_way(runs, tmp_path)
    finally:   # a failed check leaves no command behind (each takes its servers along)
        for command, _ in runs.values():
            command.kill()
            command.wait()


def _end_each_way(runs: dict, tmp_path: Path) -> None:
    trees, waiting, deadline = {}, dict(runs), time.monotonic() + 1200
    while waiting:
        # Each run is ended as soon as it is seen mid-run (answers on disk, more to come), whichever gets there
        # first: a run left waiting while others are ended one by one (on 2 free cores, the whole bundled set in
        # about a minute) could finish its prompts first, and then there would be nothing left to stop.
        started = {ending: (command, output) for ending, (command, output) in waiting.items()
                   if _answered(output) >= 2 or command.poll() is not None}
        if not started:
            assert time.monotonic() < deadline, f"{sorted(waiting)}: no answer in 1200 s"
            time.sleep(0.5)
            continue
        ending, (command, output) = next(iter(started.items()))
        del waiting[ending]
        err = (tmp_path / f"{ending.replace(' ', '_')}.err").read_text()
        assert command.poll() is None and _answered(output) >= 2, f"{ending}: not mid-run:\n{err[-3000:]}"
        supervisor = _supervisor_of(command.pid)
        # The API server (the supervisor's child), its engine core, the engine's worker, the resource tracker.
        complete_tree(supervisor, ("VLLM::EngineCore", "VLLM::Worker", "resource_tracker"))
        trees[ending] = server_tree(supervisor)
        if ending == "server died":   # the API server, not what it started
            os.kill(_process_named(supervisor, SERVER_MODULE), signal.SIGKILL)
        else:
            command.send_signal(getattr(signal, ending))
    for ending, (command, output) in runs.items():
        code = command.wait(timeout=300)
        err = (tmp_path / f"{ending.replace(' ', '_')}.err").read_text()
        assert not still_alive(trees[ending]), f"{ending}: processes of the server outlived the command"
        parts = output.with_name(output.name + ".parts")
        if ending in ("SIGTERM", "SIGINT"):
            kept = _answered(output)
            assert code == 128 + getattr(signal, ending), err[-3000:]
            assert f"stopped by {ending}: {kept} of " in err and f"prompts answered and kept in {parts}; run the " \
                   f"same command again" in err, err[-3000:]
            assert "Traceback" not in err, err[-3000:]
        elif ending == "server died":
            assert code == 1, err[-3000:]
            assert "the vllm serve this command started" in err and "died with exit code 137 (killed by SIGKILL)" \
                in err and "kept in" in err, err[-3000:]
        logs = [word.strip("(),") for line in err.splitlines() if "vllm serve of" in line
                for word in line.split() if word.strip("(),").endswith(".log")]
        assert logs, err[-3000:]
        for log in logs:   # a temporary log is kept only where an error names it
            assert Path(log).exists() == (ending == "server died"), f"{ending}: {log}"
            if ending == "server died":
                Path(log).unlink()
