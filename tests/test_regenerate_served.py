"""`launcher.regenerate regenerate.engine=openai|vllm`: regeneration through chat servers.

Most tests talk to a small OpenAI-compatible server in this process (FakeChatServer), which
answers from what it was sent, fails, or closes its port on cue; the vLLM tests at the end serve
the tiny target with a real `vllm serve` (make vllm-env) and compare the records with the HF
engine's."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_core.target.tiny import BUNDLED_DATASET
from launcher.config import ConfigError
from launcher.regenerate import run
from launcher.regeneration.served import NothingAnswered, RegenerationIncomplete, assistant_turn
from launcher.run_io import lock
from launcher.run_io.lock import LockBusy
from launcher.serving.vllm_server import free_port
from tests import served
from tests.launching import REPO

STOP = 2   # the tiny tokenizer's <|im_end|>

CHATS = [
    {"id": "multi", "conversations": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "the data's first answer"}, {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "the data's second answer"}]},
    {"id": "think", "conversations": [{"role": "user", "content": "think about it"}]},
    {"id": "tool", "conversations": [{"role": "user", "content": "use a tool"}],
     "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
    *({"id": f"plain-{k}", "conversations": [{"role": "user", "content": f"question {k}"},
                                             {"role": "assistant", "content": "old"}]} for k in range(5)),
]


def reply(body: dict) -> dict:
    """What the fake server answers: the last message echoed, the assistant turns it was sent
    (so a test sees what each turn was conditioned on), think tags or a tool call on cue."""
    messages = body["messages"]
    before = [m["content"] for m in messages if m["role"] == "assistant"]
    content = f"re: {messages[-1]['content']} after {before}"
    message = {"role": "assistant", "content": content}
    if "think" in messages[-1]["content"]:
        message["content"] = f"<think>\nweighing it\n</think>\n\n{content}"
    if "tool" in messages[-1]["content"]:
        message["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop",
                         "token_ids": [5, 6, 7, STOP]}], "usage": {"completion_tokens": 4}}


class FakeChatServer:
    """An OpenAI-compatible server on a loopback `port` (default: a free one). `fail_first`: that many chat
    requests get HTTP 503 first; `close_after`: after that many answers the port closes (a server that died);
    `delay_s`: each chat request waits this long before its answer or failure; `answer`: body ->
    (HTTP status, payload) in place of `reply` (a server that refuses everything or answers wrongly)."""

    def __init__(self, *, fail_first: int = 0, close_after: int | None = None, refuse: str | None = None,
                 delay_s: float = 0.0, answer=None, port: int = 0):
        self.requests: list[dict] = []
        self.refuse = refuse   # a last message of this content gets HTTP 400 (as a prompt over the context does)
        self.fail_first, self.close_after, self.answered, self.closing = fail_first, close_after, 0, False
        self.delay_s, self.answer = delay_s, answer
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake-target"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":   # e.g. /tokenize: not served, as by SGLang
                    return self._send(404, {"error": "Not Found"})
                time.sleep(fake.delay_s)
                with lock:
                    fake.requests.append(body)
                    dead = fake.close_after is not None and fake.answered >= fake.close_after
                    failing = not dead and len(fake.requests) <= fake.fail_first
                    fake.answered += not (dead or failing)
                    closing, fake.closing = dead and not fake.closing, fake.closing or dead
                if closing:   # the port closes; this request's connection drops unanswered
                    threading.Thread(target=fake.close).start()
                if dead:
                    self.close_connection = True
                elif failing:
                    self._send(503, {"error": "overloaded"})
                elif body["messages"][-1]["content"] == fake.refuse:
                    self._send(400, {"error": "This model's maximum context length is 1024 tokens"})
                elif fake.answer is not None:
                    self._send(*fake.answer(body))
                else:
                    self._send(200, reply(body))

        lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(chat) + "\n" for chat in CHATS))
    return path


def _run(tiny_target_dir, chats, output, *endpoints, **settings) -> int:
    overrides = {"engine": "openai", "input": chats, "output": output, "endpoints": f"[{','.join(endpoints)}]",
                 "concurrency": 2, "retry_backoff_s": 0.01, "max_retries": 2, **settings}
    return run([f"target.path={tiny_target_dir}", *(f"regenerate.{key}={value}" for key, value in overrides.items())])


def _records(output: Path) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_every_assistant_turn_is_regenerated_in_order_on_the_turns_before_it(tmp_path, chats, tiny_target_dir):
    server = FakeChatServer()
    output = tmp_path / "out.jsonl"
    assert _run(tiny_target_dir, chats, output, server.url) == 0
    records = _records(output)
    assert [r["id"] for r in records] == [c["id"] for c in CHATS]   # input order, whatever finished first
    multi = records[0]["conversations"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert multi[2]["content"] == "re: first question after []"
    # The second answer was asked with the regenerated first one, never the data's.
    assert multi[4]["content"] == "re: second question after ['re: first question after []']"
    assert multi[2]["token_ids"] == [5, 6, 7] == multi[4]["token_ids"]   # the stop token is not kept
    sent = [r["messages"] for r in server.requests if r["messages"][-1]["content"] == "second question"]
    assert [m["content"] for m in sent[0]] == ["Be brief.", "first question", "re: first question after []",
                                               "second question"]
    assert all("token_ids" not in m for r in server.requests for m in r["messages"])
    assert all(r["return_token_ids"] and r["stop_token_ids"] == [STOP] and r["temperature"] == 0
               for r in server.requests)
    think = records[1]["conversations"][-1]
    assert think["reasoning_content"] == "weighing it" and think["content"] == "re: think about it after []"
    tool = records[2]
    asked = next(r for r in server.requests if r["messages"][-1]["content"] == "use a tool")
    assert tool["tools"] == CHATS[2]["tools"] == asked["tools"]
    assert tool["conversations"][-1]["tool_calls"] == [{"type": "function", "id": "call_1",
                                                        "function": {"name": "lookup", "arguments": {"q": "x"}}}]
    assert not output.with_name(output.name + ".parts").exists()


def test_the_reasoning_field_of_the_server_is_kept():
    choice = {"message": {"content": "42", "reasoning": "six times seven"}, "token_ids": [9]}
    assert assistant_turn(choice, {STOP}) == {"role": "assistant", "content": "42",
                                              "reasoning_content": "six times seven", "token_ids": [9]}


def test_a_failing_server_is_retried_then_counts_as_down(tmp_path, chats, tiny_target_dir):
    flaky = FakeChatServer(fail_first=2)
    output = tmp_path / "out.jsonl"
    assert _run(tiny_target_dir, chats, output, flaky.url, concurrency=1, limit=1, max_retries=2) == 0
    assert len(flaky.requests) == 2 + 2 and len(_records(output)) == 1   # 2 failed, then both turns answered

    failing = FakeChatServer(fail_first=10)
    with pytest.raises(RegenerationIncomplete, match=r"1 of 1 prompts are left unanswered \(ids 'multi'\)") as down:
        _run(tiny_target_dir, chats, tmp_path / "again.jsonl", failing.url, concurrency=1, limit=1, max_retries=1)
    assert f"POST {failing.url}/v1/chat/completions: 2 attempts failed, the last with: HTTP 503" in str(down.value)
    assert len(failing.requests) == 2


def test_an_answer_torn_off_mid_body_is_a_failed_request_retried_then_down():
    """A server killed while it sends an answer (CI saw vLLM's API server SIGKILLed mid-response) leaves the
    body shorter than its Content-Length: http.client's IncompleteRead, which is no OSError. It is a failed
    request like a reset connection: retried, then the server is down, saying why."""
    from launcher.serving.openai_client import OpenAIClient, ServerDown

    class Torn(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "969")
            self.end_headers()
            self.wfile.write(b'{"data": [')
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Torn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAIClient(f"http://127.0.0.1:{server.server_address[1]}", max_retries=1, backoff_s=0.0)
        with pytest.raises(ServerDown, match=r"/v1/models: 2 attempts failed, the last with: "
                                             r"IncompleteRead\(10 bytes read, 959 more expected\)"):
            client._request("/v1/models")
    finally:
        server.shutdown()
        server.server_close()


def test_a_prompt_the_server_refuses_is_skipped_naming_it(tmp_path, chats, tiny_target_dir, capfd):
    server = FakeChatServer(refuse="question 3")
    output = tmp_path / "out.jsonl"
    assert _run(tiny_target_dir, chats, output, server.url) == 0
    assert "plain-3" not in [r["id"] for r in _records(output)] and len(_records(output)) == len(CHATS) - 1
    assert sum(r["messages"][-1]["content"] == "question 3" for r in server.requests) == 1   # not retried
    err = capfd.readouterr().err
    assert "(id 'plain-3'): refused, not answered" in err and "maximum context length is 1024" in err


def test_an_unreachable_endpoint_is_named_before_any_work(tmp_path, chats, tiny_target_dir):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"regenerate.endpoints: '{url}' does not answer .*start the server"):
        _run(tiny_target_dir, chats, tmp_path / "out.jsonl", url)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]
    with pytest.raises(ConfigError, match="regenerate.endpoints: 'localhost:8000' is not an http"):
        _run(tiny_target_dir, chats, tmp_path / "out.jsonl", "localhost:8000")
    with pytest.raises(ConfigError, match="regenerate.endpoints=.*regenerate.engine=openai, not hf"):
        _run(tiny_target_dir, chats, tmp_path / "out.jsonl", "http://127.0.0.1:1", engine="hf")


def test_a_server_that_cannot_say_what_it_serves_is_named_once_as_not_checked(tmp_path, chats, tiny_target_dir,
                                                                               capfd):
    """The fake serves 'fake-target' (no model directory here) and tokenizes nothing on request, as
    SGLang: whether it serves target.path cannot be told, and the log says so at info, once per server."""
    server = FakeChatServer()
    assert _run(tiny_target_dir, chats, tmp_path / "out.jsonl", server.url) == 0
    said = [line for line in capfd.readouterr().err.splitlines() if "is not checked" in line]
    assert len(said) == 1 and " INFO " in said[0], said
    assert f"regenerate.endpoints: the server at {server.url} serves 'fake-target'" in said[0]


def test_a_server_that_dies_loses_no_finished_answer_and_the_rerun_answers_the_rest(tmp_path, chats,
                                                                                     tiny_target_dir):
    dying = FakeChatServer(close_after=4)   # the multi-turn chat (2 turns), then 2 more; then the port closes
    output = tmp_path / "out.jsonl"
    with pytest.raises(RegenerationIncomplete) as failure:
        _run(tiny_target_dir, chats, output, dying.url, concurrency=1)
    message = str(failure.value)
    assert f"5 of {len(CHATS)} prompts are left unanswered (ids 'plain-0', 'plain-1'" in message
    assert "the 3 answers finished are kept in" in message and "run the same command again" in message
    parts = output.with_name(output.name + ".parts")
    assert sorted(json.loads(line)["index"] for line in (parts / "rank00000.jsonl").read_text().splitlines()) == \
        [0, 1, 2]
    assert not output.exists()

    healthy = FakeChatServer()
    assert _run(tiny_target_dir, chats, output, healthy.url) == 0
    assert len(healthy.requests) == 5   # only the prompts left
    assert [r["id"] for r in _records(output)] == [c["id"] for c in CHATS] and not parts.exists()


# ----------------------------------------------------------------------------- client failures are clear
@pytest.mark.parametrize("status,words", [(404, "The model `fake-target` does not exist."),
                                          (400, "unknown field: return_token_ids")])
def test_every_prompt_refused_exits_non_zero_with_the_reason_and_no_output(tmp_path, chats, tiny_target_dir,
                                                                          status, words):
    """Issue 46: every chat request answered 404 (or 400): exit 0, `wrote 0 records`, a 0-byte output."""
    server = FakeChatServer(answer=lambda body: (status, {"error": words}))
    with pytest.raises(NothingAnswered, match=rf"none of the {len(CHATS)} prompts got an answer: {len(CHATS)} "
                                              rf"refused \(the first: POST {server.url}/v1/chat/completions: HTTP "
                                              rf"{status}: .*{re.escape(words)}.*\); no output was written"):
        _run(tiny_target_dir, chats, tmp_path / "out.jsonl", server.url)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]   # no output, parts or lock


@pytest.mark.parametrize("answer,missing", [({"object": "error", "message": "upstream timed out"}, "`choices`"),
                                           ({"choices": [{"text": "completion, not chat"}]}, "`choices[0].message`")])
def test_a_malformed_answer_names_the_endpoint_and_what_was_missing(tmp_path, chats, tiny_target_dir, answer,
                                                                    missing):
    """Issue 46: an HTTP 200 without `choices` ended in a bare `KeyError: 'choices'`; with no answer
    finished, the run said "the 0 answers finished are kept" and left an empty parts directory."""
    server = FakeChatServer(answer=lambda body: (200, answer))
    with pytest.raises(RegenerationIncomplete, match=rf"POST {server.url}/v1/chat/completions: 2 attempts failed, "
                                                     rf"the last with: HTTP 200 without {re.escape(missing)} "
                                                     rf"\(the answer: {re.escape(json.dumps(answer))}\)"
                                                     rf".*; no answer finished, so nothing is kept and there is "
                                                     rf"nothing to resume: run the same command again"):
        _run(tiny_target_dir, chats, tmp_path / "out.jsonl", server.url, concurrency=1, limit=1, max_retries=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]   # no output, parts or lock


def test_a_failing_server_gives_its_prompts_to_the_healthy_one(tmp_path, chats, tiny_target_dir, capfd):
    """Issue 46: once the healthy server's workers had emptied the queue, the prompts of the server
    that failed were stranded, and the run said every server stopped answering."""
    failing = FakeChatServer(close_after=1, delay_s=0.3)   # one answer, then its port closes
    healthy = FakeChatServer()
    output = tmp_path / "out.jsonl"
    assert _run(tiny_target_dir, chats, output, failing.url, healthy.url) == 0
    assert [r["id"] for r in _records(output)] == [c["id"] for c in CHATS]
    err = capfd.readouterr().err
    warnings = [line for line in err.split("wrote")[0].splitlines() if "WARNING" in line]
    assert err.count(f"WARNING server {failing.url} is down") == 1 and not any(healthy.url in w for w in warnings)
    summary = err[err.index("wrote 8 records"):]
    assert f"server {failing.url} was down for a while" in summary and f"server {healthy.url}" not in summary


def test_each_change_of_a_server_state_is_logged_once(tmp_path, chats, tiny_target_dir, capfd):
    """Issue 46: "server is down" came once per request in flight (16 times); a server that answers
    again takes prompts again."""
    flaky = FakeChatServer(fail_first=2)   # its first request fails twice (max_retries=1): down; then it answers
    slow = FakeChatServer(delay_s=0.2)     # still busy with the 8 chats when the flaky one is back
    output = tmp_path / "out.jsonl"
    assert _run(tiny_target_dir, chats, output, flaky.url, slow.url, max_retries=1, concurrency=1) == 0
    err = capfd.readouterr().err
    assert err.count(f"server {flaky.url} is down") == 1 and err.count(f"INFO server {flaky.url} is back up") == 1
    assert flaky.answered > 0 and len(_records(output)) == len(CHATS)


def test_a_prompt_that_makes_every_server_fail_is_not_asked_for_ever(tmp_path, chats, tiny_target_dir, capfd):
    """Each server fails it (HTTP 500, slowly) but answers /health and the other prompts: each is back
    up before the other fails it, and without a bound it would go from one to the other for ever."""
    def answer(body):
        if body["messages"][-1]["content"] != "question 2":
            return 200, reply(body)
        time.sleep(0.2)   # >> the probe interval (retry_backoff_s=0.01 with max_retries=0)
        return 500, {"error": "internal"}
    servers = [FakeChatServer(answer=answer), FakeChatServer(answer=answer)]
    output = tmp_path / "out.jsonl"
    assert _run(tiny_target_dir, chats, output, *(s.url for s in servers), max_retries=0, concurrency=1) == 0
    assert [r["id"] for r in _records(output)] == [c["id"] for c in CHATS if c["id"] != "plain-2"]
    assert "(id 'plain-2'): not answered: it failed 3 times, on every server (the last: POST" in capfd.readouterr().err


# `vllm serve` stood in by a FakeChatServer on the port it is given (the fake python of regenerate.vllm_python):
# it logs an error of vLLM's start-up compile that vLLM survives, answers 3 requests, closes its port, says
# why it died and exits.
_DYING_SERVER = """
import sys
sys.path.insert(0, {repo!r})
from tests.test_regenerate_served import FakeChatServer
print("AssertionError: Please convert all Tensors to FakeTensors first", flush=True)
fake = FakeChatServer(port=int(sys.argv[sys.argv.index("--port") + 1]), close_after=3)
fake.thread.join()
print("RuntimeError: the engine core died", flush=True)
sys.exit(3)
"""


def test_a_started_server_that_died_is_given_up_at_once_and_named_by_what_it_said_after_start_up(
        tmp_path, chats, tiny_target_dir):
    """Issue 46: after the supervisor had said the server was dead, its requests were retried for
    31 s; the death's excerpt showed vLLM's start-up noise, not what came after."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{_DYING_SERVER.format(repo=str(REPO))}")
    fake.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(RegenerationIncomplete) as failure:
        _run(tiny_target_dir, chats, tmp_path / "out.jsonl", engine="vllm", vllm_python=fake, concurrency=1,
             max_retries=5, retry_backoff_s=4)
    took = time.monotonic() - started
    message = str(failure.value)
    log = Path(message.split("its log ", 1)[1].split(" that matter", 1)[0])
    try:
        # Retrying a dead server would wait 4 + 8 + 16 + 32 + 64 = 124 s; given up at once, the run takes
        # the fake's start (a python importing torch) and at most one wait of 4 s, a loaded machine's
        # seconds included.
        assert took < 60, f"{took:.0f} s: {message}"
        assert "died with exit code 3" in message and "RuntimeError: the engine core died" in message, message
        assert "the server is ready" in message and "FakeTensors" not in message, message
    finally:
        log.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- no finished answer is lost
def _interrupted(tiny_target_dir, chats, output) -> Path:
    """A run stopped after 3 of the chats were answered (its server died): their parts are kept."""
    with pytest.raises(RegenerationIncomplete):
        _run(tiny_target_dir, chats, output, FakeChatServer(close_after=4).url, concurrency=1)
    parts = output.with_name(output.name + ".parts")
    assert len((parts / "rank00000.jsonl").read_text().splitlines()) == 3
    return parts


@pytest.fixture
def live_holder(tmp_path):
    """(a lock on tmp_path/out.jsonl as another live regenerate on this machine leaves it, that process)."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    record = {**lock._identity(), "pid": holder.pid, "pid_start": lock._start_ticks(holder.pid),
              "command": "python -m launcher.regenerate regenerate.output=out.jsonl"}
    (tmp_path / "out.jsonl.lock").write_text(json.dumps(record))
    yield record, holder
    holder.kill()
    holder.wait()


def test_a_second_run_on_one_output_is_refused_naming_the_first(tmp_path, chats, tiny_target_dir, live_holder,
                                                                 capfd):
    """Issue 46: two runs on one output shared its parts; the second failed and the output was 0 bytes."""
    record, holder = live_holder
    server, output = FakeChatServer(), tmp_path / "out.jsonl"
    with pytest.raises(LockBusy, match=rf"regenerate.output='{output}' is in use by another job: host \S+ pid "
                                       rf"{holder.pid} started .*running python -m launcher.regenerate "
                                       rf"regenerate.output=out.jsonl; wait for it to end or choose another"):
        _run(tiny_target_dir, chats, output, server.url)
    assert server.requests == [] and not output.exists() and not output.with_name("out.jsonl.parts").exists()

    holder.kill()   # the holder died (SIGKILL): its lock is stale, taken over with a warning
    holder.wait()
    assert _run(tiny_target_dir, chats, output, server.url) == 0
    err = capfd.readouterr().err
    assert f"WARNING taking over the lock of host {record['host']} pid {holder.pid}" in err
    assert "its processes on this machine are gone" in err
    assert len(_records(output)) == len(CHATS) and not (tmp_path / "out.jsonl.lock").exists()


def test_the_hf_engine_also_refuses_a_second_run_on_one_output(tmp_path, tiny_target_dir, live_holder):
    from tests.test_regenerate_output import _regenerate
    _, holder = live_holder
    proc = _regenerate(tiny_target_dir, BUNDLED_DATASET, tmp_path / "out.jsonl")
    assert proc.returncode == 1
    assert "is in use by another job: host" in proc.stderr and f"pid {holder.pid} started" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.parts").exists()


def test_a_rerun_resumes_whichever_way_the_input_is_spelt(tmp_path, chats, tiny_target_dir, monkeypatch):
    """Issue 46: the input spelt relative (or through a link) after an absolute spelling discarded
    every finished answer, silently."""
    output = tmp_path / "out.jsonl"
    _interrupted(tiny_target_dir, chats, output)
    (tmp_path / "link.jsonl").symlink_to(chats)
    monkeypatch.chdir(tmp_path)
    dying = FakeChatServer(close_after=1)   # answers one more chat, relative spelling, then dies
    with pytest.raises(RegenerationIncomplete, match="the 4 answers finished are kept"):
        _run(tiny_target_dir, "chats.jsonl", output, dying.url, concurrency=1)
    healthy = FakeChatServer()
    assert _run(tiny_target_dir, "link.jsonl", output, healthy.url) == 0
    assert len(healthy.requests) == 4 and [r["id"] for r in _records(output)] == [c["id"] for c in CHATS]


def test_parts_of_other_settings_are_kept_until_the_user_discards_them(tmp_path, chats, tiny_target_dir, capfd):
    output = tmp_path / "out.jsonl"
    parts = _interrupted(tiny_target_dir, chats, output)
    before = (parts / "rank00000.jsonl").read_text()
    server = FakeChatServer()
    with pytest.raises(ConfigError, match=rf"{parts} holds 3 finished answers of an earlier run with other settings "
                                          r"\(regenerate.max_new_tokens: 2048 then, 16 now\): run with the earlier "
                                          r"settings to resume it, or set regenerate.resume=false to discard"):
        _run(tiny_target_dir, chats, output, server.url, max_new_tokens=16)
    with chats.open("a") as f:   # the input's content changed, its name did not
        f.write(json.dumps({"id": "new", "conversations": [{"role": "user", "content": "new question"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"\(regenerate.input's content \(sha256\): '\w+' then, '\w+' now\)"):
        _run(tiny_target_dir, chats, output, server.url)
    assert (parts / "rank00000.jsonl").read_text() == before and server.requests == []

    assert _run(tiny_target_dir, chats, output, server.url, max_new_tokens=16, resume="false") == 0
    assert f"WARNING regenerate.resume=false: discarding the 3 answers in {parts} of an earlier run" in \
        capfd.readouterr().err
    assert len(_records(output)) == len(CHATS) + 1 and not parts.exists()


# ----------------------------------------------------------------------------- a real vLLM server
NUM_CHATS = 24   # the first bundled chats: single-turn ones and multi-turn ones (4 and 5 turns)


def _regenerate(target, output, *overrides) -> subprocess.CompletedProcess:
    from dflash_core.target.tiny import BUNDLED_DATASET
    return subprocess.run([sys.executable, "-m", "launcher.regenerate", f"target.path={target}",
                           f"regenerate.input={BUNDLED_DATASET}", f"regenerate.output={output}",
                           f"regenerate.limit={NUM_CHATS}", "regenerate.max_new_tokens=32", "regenerate.device=cpu",
                           "target.dtype=fp32", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=1500, check=False)


@pytest.fixture(scope="session")
def regenerated_by_both_engines(tiny_target_dir, tmp_path_factory):
    """The first bundled chats regenerated by the HF engine and by engine=vllm (its own server)."""
    served.require_vllm_env()
    root = tmp_path_factory.mktemp("regenerated")
    hf = _regenerate(tiny_target_dir, root / "hf.jsonl")
    assert hf.returncode == 0, hf.stderr[-3000:]
    vllm = _regenerate(tiny_target_dir, root / "vllm.jsonl", "regenerate.engine=vllm",
                       f"regenerate.vllm_args=[{','.join(served.SERVER_ARGS)}]")
    assert vllm.returncode == 0, vllm.stderr[-3000:]
    return _records(root / "hf.jsonl"), _records(root / "vllm.jsonl"), vllm.stderr


def _form(record: dict) -> list:
    return [sorted(record), [(m["role"], sorted(m)) for m in record["conversations"]]]


@pytest.mark.xdist_group("vllm")
@pytest.mark.timeout(1800)
def test_vllm_and_hf_engines_write_records_of_one_form(regenerated_by_both_engines):
    hf, vllm, log = regenerated_by_both_engines
    assert [r["id"] for r in vllm] == [r["id"] for r in hf] and len(hf) >= NUM_CHATS - 2
    assert any(len(r["conversations"]) >= 4 for r in hf), "no multi-turn chat among them"
    assert [_form(r) for r in vllm] == [_form(r) for r in hf]
    for a, b in zip(hf, vllm):   # the prompts' own turns are kept alike
        assert [m for m in a["conversations"] if m["role"] != "assistant"] == \
            [m for m in b["conversations"] if m["role"] != "assistant"]
        assert all(m["token_ids"] for m in b["conversations"] if m["role"] == "assistant")
    assert "tokens/s" in log and "regenerating" in log


@pytest.mark.xdist_group("vllm")
@pytest.mark.timeout(1800)
def test_vllm_answers_are_the_greedy_answers_of_the_hf_engine(regenerated_by_both_engines):
    """Both greedy in float32 on one target: the generated ids agree but where near-tied logits
    round apart (the two engines' kernels), which may happen on a few of the turns."""
    hf, vllm, _ = regenerated_by_both_engines
    turns = [(a["token_ids"], b["token_ids"]) for x, y in zip(hf, vllm)
             for a, b in zip(x["conversations"], y["conversations"]) if a["role"] == "assistant"]
    same = sum(a == b for a, b in turns)
    assert same >= 0.75 * len(turns), f"only {same} of {len(turns)} turns generated alike"
