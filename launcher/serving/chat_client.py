"""One OpenAI-compatible chat server (vLLM, SGLang): `/v1/chat/completions` with retries.

A request the server failed (no answer: refused, reset or timed out; HTTP 5xx; 429) is retried
after waits that double from `backoff_s`; after `max_retries` retries the server counts as down
(ServerDown). A request it refused for what it asked (another HTTP 4xx: a prompt over the
context, a bad parameter) is not retried (RequestRefused): another server would refuse it too.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class ServerDown(RuntimeError):
    """The server failed a request max_retries + 1 times in a row."""


class RequestRefused(ValueError):
    """The server answered a request with an HTTP 4xx other than 429."""


def _request(url: str, payload: dict | None, timeout: float) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode())


class ChatClient:
    def __init__(self, url: str, *, max_retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 1800.0):
        self.url = url.rstrip("/")
        self.max_retries, self.backoff_s, self.timeout_s = max_retries, backoff_s, timeout_s
        self.model: str | None = None

    def connect(self, timeout_s: float = 30.0) -> str:
        """The served model's name (GET /v1/models, once, no retries); ServerDown saying why when
        nothing answers there."""
        try:
            models = _request(f"{self.url}/v1/models", None, timeout_s)["data"]
        except urllib.error.HTTPError as err:
            raise ServerDown(f"GET {self.url}/v1/models: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as err:
            raise ServerDown(f"GET {self.url}/v1/models: {getattr(err, 'reason', err)}") from None
        if not models:
            raise ServerDown(f"GET {self.url}/v1/models: the server serves no model")
        self.model = models[0]["id"]
        return self.model

    def chat(self, payload: dict) -> dict:
        """The response of POST /v1/chat/completions (`model` filled in), retried as the module says."""
        body, last = {"model": self.model, **payload}, ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return _request(f"{self.url}/v1/chat/completions", body, self.timeout_s)
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:1000]
                if 400 <= err.code < 500 and err.code != 429:
                    raise RequestRefused(f"{self.url}: HTTP {err.code}: {detail}") from None
                last = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, OSError, ValueError) as err:   # refused, reset, timed out, torn
                last = str(getattr(err, "reason", err))
        raise ServerDown(f"{self.url}: {self.max_retries + 1} attempts failed, the last with: {last}")
