"""`launcher.regenerate regenerate.engine=openai|vllm`: regeneration through chat servers.

Most tests talk to a small OpenAI-compatible server in this process (FakeChatServer), which
answers from what it was sent, fails, or closes its port on cue; the vLLM tests at the end serve
the tiny target with a real `vllm serve` (make vllm-env) and compare the records with the HF
engine's."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from launcher.config import ConfigError
from launcher.regenerate import run
from launcher.regeneration.served import RegenerationIncomplete, assistant_turn
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
    """An OpenAI-compatible server on a free loopback port. `fail_first`: that many chat requests
    get HTTP 503 first; `close_after`: after that many answers the port closes (a server that died)."""

    def __init__(self, *, fail_first: int = 0, close_after: int | None = None, refuse: str | None = None):
        self.requests: list[dict] = []
        self.refuse = refuse   # a last message of this content gets HTTP 400 (as a prompt over the context does)
        self.fail_first, self.close_after, self.answered, self.closing = fail_first, close_after, 0, False
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
                else:
                    self._send(200, reply(body))

        lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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
