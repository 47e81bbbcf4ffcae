"""The HTTP client the audit sends every request through: bounded, patient, and careful with the key.

A team points the audit at a server it runs in production, so the client behaves as one it
would let near it:

* `concurrency` requests in flight at most (`Client.map`, a thread pool of that size);
* a timeout on every request, and retries with exponential backoff on 429 and 503 (and on a
  dropped connection), honouring `Retry-After` where the server sends one;
* the API key read from the environment variable the user names, sent as a bearer token and
  never stored on the client's record (`Endpoint.public`), in a record, a report or a log;
* TLS verified by default (`ssl.create_default_context`); only http:// and https:// URLs.

The standard library's `urllib` does the work: no dependency for a few JSON posts.
"""

from __future__ import annotations

import json
import os
import random
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ..errors import KvevictError

T = TypeVar("T")
R = TypeVar("R")

#: statuses worth waiting out: the server is busy or rate-limits, it has not refused the request
RETRY_STATUSES = (429, 503)


class ServerError(KvevictError):
    """The server answered with an error the audit cannot retry (the message says which); `status` its HTTP code
    (0: not an HTTP error)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """Where a server is and how to reach it. `api_key_env`: the name of the environment variable that holds
    the key (the key itself is read at each request and never kept here)."""

    url: str
    api_key_env: str | None = None
    timeout: float = 120.0
    retries: int = 4
    backoff: float = 0.5  # seconds before the first retry, doubled each time
    concurrency: int = 4

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise KvevictError(f"the server URL must be http:// or https:// with a host, got '{self.url}': "
                               "e.g. http://127.0.0.1:8080")
        if parsed.username or parsed.password:
            raise KvevictError("the server URL carries credentials: put the key in an environment variable and "
                               "name it with --api-key-env")
        if self.concurrency < 1:
            raise KvevictError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.timeout <= 0 or self.retries < 0:
            raise KvevictError("the request timeout must be above 0 seconds and the retries at least 0")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    def key(self) -> str | None:
        if not self.api_key_env:
            return None
        found = os.environ.get(self.api_key_env)
        if not found:
            raise KvevictError(f"--api-key-env {self.api_key_env}: that environment variable is not set")
        return found


class Client:
    """JSON over HTTP to one `Endpoint`. `opener` stands in for `urllib.request.urlopen` (its signature)."""

    def __init__(self, endpoint: Endpoint, opener: Callable | None = None, sleep: Callable[[float], None] = time.sleep):
        self.endpoint = endpoint
        self._open = opener or urllib.request.urlopen
        self._sleep = sleep
        self._tls = ssl.create_default_context()  # verified: the system's roots, hostname checked
        self.sent = 0  # requests that reached the server (retries counted)

    def get(self, path: str) -> dict:
        return self._request(path, None)

    def post(self, path: str, body: dict) -> dict:
        return self._request(path, body)

    def map(self, work: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`work` over `items`, at most `concurrency` at once, in the items' order."""
        items = list(items)
        if self.endpoint.concurrency == 1 or len(items) <= 1:
            return [work(x) for x in items]
        with ThreadPoolExecutor(max_workers=self.endpoint.concurrency) as pool:
            return list(pool.map(work, items))

    def _request(self, path: str, body: dict | None) -> dict:
        url = self.endpoint.base + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = self.endpoint.key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        delay = self.endpoint.backoff
        for attempt in range(self.endpoint.retries + 1):
            request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
            last = attempt == self.endpoint.retries
            try:
                self.sent += 1
                kwargs = {"context": self._tls} if url.startswith("https") else {}
                with self._open(request, timeout=self.endpoint.timeout, **kwargs) as answer:
                    return _json(answer.read(), url)
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRY_STATUSES or last:
                    raise _http_error(exc, url) from None
                after = _retry_after(exc)
                wait = delay if after is None else after
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if last:
                    raise KvevictError(f"cannot reach {self.endpoint.base} ({_reason(exc)}): check the URL and that "
                                       "the server is running") from None
                wait = delay
            self._sleep(wait * (1 + 0.1 * random.random()))  # a little jitter: parallel retries do not align
            delay *= 2
        raise AssertionError("unreachable")


def _json(raw: bytes, url: str) -> dict:
    try:
        found = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ServerError(f"{url} did not answer JSON: is it an inference server's API?") from None
    if not isinstance(found, dict):
        raise ServerError(f"{url} answered JSON that is not an object")
    return found


def _http_error(exc: urllib.error.HTTPError, url: str) -> ServerError:
    try:
        detail = exc.read().decode("utf-8", "replace")[:300]
    except OSError:
        detail = ""
    try:
        message = json.loads(detail).get("error", detail)
        detail = message.get("message", str(message)) if isinstance(message, dict) else str(message)
    except (json.JSONDecodeError, AttributeError):
        pass
    if exc.code in (401, 403):
        return ServerError(f"{url} refused the request ({exc.code}): give its key with --api-key-env VAR", exc.code)
    if exc.code == 404:
        return ServerError(f"{url} does not exist on this server (404): check --api (llama, completions, chat)", 404)
    return ServerError(f"{url} answered {exc.code}: {' '.join(detail.split())}", exc.code)


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    value = exc.headers.get("Retry-After") if exc.headers else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", exc)
    return str(reason) or type(exc).__name__
