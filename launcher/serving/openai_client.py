"""The client of one OpenAI-compatible server (vLLM, SGLang): chat and token-id completions, the
served model (name and path), and what those servers serve besides: `/health`, Prometheus
`/metrics`, vLLM's `/tokenize` and (in its development mode) `/server_info`.

Every request takes one path with one retry policy. A request the server failed (no answer:
refused, reset, timed out or torn; HTTP 5xx; 429) is retried after waits that double from
`backoff_s`; after `max_retries` retries the server counts as down (ServerDown). A request it
refused for what it asked (another HTTP 4xx: a prompt over the context, a bad parameter) is not
retried (RequestRefused): another server would refuse it too. Nor is a request to a server known
dead (`dead`, e.g. VllmServer.gone of a server started here): it is down at once. A completion
answered without its `choices` (an HTTP 200 from something that is not quite an OpenAI server: a
proxy's error page, a truncated answer) counts as a failed request, saying what was missing. Errors
name the method, the URL, the HTTP code with the server's own words, and the attempts.

The standard library's urllib carries the requests: the `openai` package waits between retries on
its own schedule (not `backoff_s`), retries 408 and 409 too and knows no /health or /metrics, and
httpx retries only failed connects, so either would still need this retry loop.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable


class ServerError(OSError):
    """A server could not be started, stopped answering, or answered with an error; the message
    says which and why."""


class ServerDown(ServerError):
    """The server failed a request max_retries + 1 times in a row."""


class RequestRefused(ServerError):
    """The server answered a request with an HTTP 4xx other than 429."""


def _completion(text: str, part: str | None = None) -> dict:
    """A completion's JSON body; ValueError saying what is missing when it holds no choice (with
    `part`, e.g. "message")."""
    answer = json.loads(text)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
        missing = "`choices`"
    elif part is not None and not isinstance(choices[0].get(part), dict):
        missing = f"`choices[0].{part}`"
    else:
        return answer
    raise ValueError(f"HTTP 200 without {missing} (the answer: {text[:300]})")


class OpenAIClient:
    """Requests to the server at `url`. `timeout_s` bounds one request's answer (a long generation's);
    `dead`, asked when a request failed: the words saying the server is dead for good, or None."""

    def __init__(self, url: str, *, max_retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 600.0,
                 dead: Callable[[], str | None] | None = None):
        self.url = url.rstrip("/")
        self.max_retries, self.backoff_s, self.timeout_s = max_retries, backoff_s, timeout_s
        self.dead = dead
        self._model: str | None = None
        self.served: dict = {}   # the served model's /v1/models entry: id, and with vLLM root (its path), max_model_len

    def _request(self, path: str, payload: dict | None = None, *, read=json.loads, timeout_s: float | None = None,
                retries: int | None = None):
        """`read` of the body of GET `path` (POST of `payload` as JSON), retried as the module says;
        `retries` (default max_retries) and `timeout_s` (default the client's) for this request."""
        method, url = ("GET" if payload is None else "POST"), f"{self.url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                    return read(response.read().decode())
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code}: {err.read().decode(errors='replace')[:1000]}"
                if 400 <= err.code < 500 and err.code != 429:
                    raise RequestRefused(f"{method} {url}: {last}") from None
            # Refused, reset, timed out, torn: a body cut short (a server killed mid-answer) is http.client's
            # IncompleteRead, which is no OSError.
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
                last = str(getattr(err, "reason", err))
            if self.dead is not None and (death := self.dead()):
                raise ServerDown(f"{method} {url}: {last}; not retried, the server is dead: {death}")
        attempts = f"{retries + 1} attempts failed, the last with: " if retries else ""
        raise ServerDown(f"{method} {url}: {attempts}{last}")

    def healthy(self) -> bool:
        """Whether the server answers GET /health now (once, no retries)."""
        try:
            self._request("/health", read=str, timeout_s=5.0, retries=0)
            return True
        except ServerError:
            return False

    def connect(self, timeout_s: float = 30.0) -> str:
        """The served model's name (GET /v1/models, once, no retries; its whole entry in `served`);
        ServerDown saying why when no model answers there."""
        try:
            answer = self._request("/v1/models", timeout_s=timeout_s, retries=0)
        except RequestRefused as err:   # no OpenAI-compatible server there
            raise ServerDown(str(err)) from None
        try:
            self.served = dict(answer["data"][0])
            self._model = self.served["id"]
        except (LookupError, TypeError, ValueError):
            raise ServerDown(f"GET {self.url}/v1/models: the server serves no model (it answered "
                             f"{json.dumps(answer)[:200]})") from None
        return self._model

    @property
    def model(self) -> str:
        return self._model or self.connect()

    def chat(self, payload: dict) -> dict:
        """The response of POST /v1/chat/completions (`model` filled in)."""
        return self._request("/v1/chat/completions", {"model": self.model, **payload},
                             read=lambda text: _completion(text, "message"))

    def _complete(self, prompt_ids: list[int], max_tokens: int, settings: dict) -> dict:
        """The first choice of a greedy completion of token ids (POST /v1/completions) with `settings`."""
        payload = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
                   **settings}
        return self._request("/v1/completions", payload, read=_completion)["choices"][0]

    def complete_ids(self, prompt_ids: list[int], *, max_tokens: int, stop_token_ids: list[int],
                     sampling: dict | None = None) -> list[int]:
        """Completion of token ids, greedy unless `sampling` gives its settings (temperature, top_p,
        seed, ...) -> the generated ids (the stop token included, as HF's decoding keeps its eos)."""
        choice = self._complete(prompt_ids, max_tokens, {
            "stop_token_ids": list(stop_token_ids), "include_stop_str_in_output": True, "skip_special_tokens": False,
            "return_token_ids": True, **(sampling or {})})
        if choice.get("token_ids") is None:
            raise ServerError(f"{self.url} returned no token_ids: a vLLM without `return_token_ids` (use >= 0.10.2)")
        return list(choice["token_ids"])

    def next_token_logprobs(self, prompt_ids: list[int], count: int) -> dict[int, float]:
        """{token id: log-probability} of the `count` likeliest tokens after `prompt_ids` (vLLM serves at
        most 20 unless started with a larger --max-logprobs); vLLM's `return_tokens_as_token_ids` names
        them by id, as text would confuse two ids of one spelling."""
        choice = self._complete(prompt_ids, 1, {"logprobs": count, "return_tokens_as_token_ids": True})
        top = (choice.get("logprobs") or {}).get("top_logprobs") or [None]
        if not top[0]:
            raise ServerError(f"{self.url} returned no top_logprobs for a completion asking logprobs={count}")
        return {int(token.removeprefix("token_id:")): logprob for token, logprob in top[0].items()}

    def tokenize(self, text: str) -> list[int] | None:
        """The ids the server's tokenizer gives `text`, no special tokens added (vLLM's POST /tokenize,
        once); None when the server has no such endpoint (it answers HTTP 4xx)."""
        try:
            answer = self._request("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False},
                                   timeout_s=30.0, retries=0)
        except RequestRefused:
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return list(tokens) if isinstance(tokens, list) else None

    def server_config(self) -> dict | None:
        """vLLM's whole engine config (GET /server_info?config_format=json, once: its `vllm_config`);
        None when the server does not expose it (vLLM does only with VLLM_SERVER_DEV_MODE=1)."""
        try:
            answer = self._request("/server_info?config_format=json", timeout_s=30.0, retries=0)
        except RequestRefused:
            return None
        config = answer.get("vllm_config") if isinstance(answer, dict) else None
        return config if isinstance(config, dict) else None

    def metrics(self) -> str:
        """The server's Prometheus page (GET /metrics)."""
        return self._request("/metrics", read=str, timeout_s=30.0)
