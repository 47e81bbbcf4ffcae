"""The HTTP client the audit sends every request through: bounded, patient, and careful with the key.

A team points the audit at a server it runs in production, so the client behaves as one it
would let near it:

* `concurrency` requests in flight at most (`Client.map`, a thread pool of that size);
* a timeout on every request, and retries with exponential backoff on 429 and 503 (and on a
  dropped connection), honouring `Retry-After` where the server sends one;
* one key per server, read from the environment variable the user names for that server, sent as a
  bearer token and never stored on the client's record, in a record, a report or a log;
* the key goes to a host beyond loopback only over https (`Endpoint.allow_plain_http_key`: the user
  says otherwise in so many words), so it is never readable on the way;
* no redirect is followed: a 3xx answer is refused in one line naming where it points. The key never
  reaches an origin the user did not name, and the audit judges the server it was given, not another;
* TLS verified (`ssl.create_default_context`: the system's roots, the hostname checked); only http://
  and https:// URLs.

`httpx2` (huggingface-hub's own HTTP client, so no new install) does the work: a pooled connection per
server, so the thousand one-token requests of a reference read by positions share their handshakes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import httpx2

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


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name localhost: traffic that never leaves the machine."""
    if host.rstrip(".").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Endpoint:
    """Where a server is and how to reach it. `api_key_env`: the name of the environment variable that holds
    its key (the key itself is read at each request and never kept here); `key_option`: the command-line option
    that names it, for the messages; `allow_plain_http_key`: the user's word that the key may cross a network
    unencrypted (http:// to a host beyond loopback)."""

    url: str
    api_key_env: str | None = None
    timeout: float = 120.0
    retries: int = 4
    backoff: float = 0.5  # seconds before the first retry, doubled each time
    concurrency: int = 4
    key_option: str = "--api-key-env"
    allow_plain_http_key: bool = False

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise KvevictError(f"the server URL must be http:// or https:// with a host, got '{self.url}': "
                               "e.g. http://127.0.0.1:8080")
        if parsed.username or parsed.password:
            raise KvevictError("the server URL carries credentials: put the key in an environment variable and "
                               f"name it with {self.key_option}")
        if self.concurrency < 1:
            raise KvevictError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.timeout <= 0 or self.retries < 0:
            raise KvevictError("the request timeout must be above 0 seconds and the retries at least 0")
        host = parsed.hostname or ""
        if self.api_key_env and parsed.scheme == "http" and not is_loopback(host) and not self.allow_plain_http_key:
            raise KvevictError(f"{self.key_option} {self.api_key_env}: the key would cross the network to {host} "
                               "unencrypted (http://): use https://, or pass --allow-plain-http-key if that "
                               "network is yours")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    def key(self) -> str | None:
        if not self.api_key_env:
            return None
        found = os.environ.get(self.api_key_env)
        if not found:
            raise KvevictError(f"{self.key_option} {self.api_key_env}: that environment variable is not set")
        return found


class Client:
    """JSON over HTTP to one `Endpoint`, over one pooled `httpx2.Client`. `transport` stands in for the network
    (an `httpx2.MockTransport` in a test); `sleep` for the wait between retries."""

    def __init__(self, endpoint: Endpoint, transport: httpx2.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.endpoint = endpoint
        self._sleep = sleep
        self._http = httpx2.Client(timeout=endpoint.timeout, follow_redirects=False, transport=transport,
                                   verify=ssl.create_default_context())
        self.sent = 0  # requests that reached the server (retries counted)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> dict:
        return _json(self._request(path, None), self.endpoint.base + path)

    def get_text(self, path: str) -> str:
        """A route that answers plain text (vLLM's Prometheus `/metrics`)."""
        return self._request(path, None).decode("utf-8", "replace")

    def post(self, path: str, body: dict) -> dict:
        return _json(self._request(path, body), self.endpoint.base + path)

    def map(self, work: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`work` over `items`, at most `concurrency` at once, in the items' order."""
        items = list(items)
        if self.endpoint.concurrency == 1 or len(items) <= 1:
            return [work(x) for x in items]
        with ThreadPoolExecutor(max_workers=self.endpoint.concurrency) as pool:
            return list(pool.map(work, items))

    def _request(self, path: str, body: dict | None) -> bytes:
        """The answer's bytes; retried on `RETRY_STATUSES` and a dropped connection, refused on anything else."""
        url = self.endpoint.base + path
        headers = {"Accept": "application/json"}
        key = self.endpoint.key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        delay = self.endpoint.backoff
        for attempt in range(self.endpoint.retries + 1):
            last = attempt == self.endpoint.retries
            try:
                self.sent += 1
                answer = self._http.request("GET" if body is None else "POST", url, json=body, headers=headers)
            except httpx2.TransportError as exc:
                if last:
                    raise KvevictError(f"cannot reach {self.endpoint.base} ({_reason(exc)}): check the URL and that "
                                       "the server is running") from None
                wait = delay
            else:
                if answer.status_code < 300:
                    return answer.content
                if 300 <= answer.status_code < 400:
                    raise ServerError(_redirected(url, answer), answer.status_code)
                if answer.status_code not in RETRY_STATUSES or last:
                    raise _http_error(answer, url, self.endpoint.key_option)
                after = _retry_after(answer)
                wait = delay if after is None else after
            self._sleep(wait * (1 + 0.1 * random.random()))  # a little jitter: parallel retries do not align
            delay *= 2
        raise AssertionError("unreachable")


def _redirected(url: str, answer: httpx2.Response) -> str:
    """The one line for a redirect: where it points (its origin and path, never its query), and the fix."""
    location = answer.headers.get("Location", "")
    target = urllib.parse.urlparse(urllib.parse.urljoin(url, location))
    where = f"{target.scheme}://{target.netloc}{target.path}" if target.netloc else "nowhere it says"
    return (f"{url} answered {answer.status_code}, a redirect to {where}: the audit follows no redirect (a key "
            "goes only where it was named): give the URL it redirects to")


def _json(raw: bytes, url: str) -> dict:
    try:
        found = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ServerError(f"{url} did not answer JSON: is it an inference server's API?") from None
    if not isinstance(found, dict):
        raise ServerError(f"{url} answered JSON that is not an object")
    return found


def _http_error(answer: httpx2.Response, url: str, key_option: str) -> ServerError:
    detail = answer.content.decode("utf-8", "replace")[:300]
    try:
        message = json.loads(detail).get("error", detail)
        detail = message.get("message", str(message)) if isinstance(message, dict) else str(message)
    except (json.JSONDecodeError, AttributeError):
        pass
    code = answer.status_code
    if code in (401, 403):
        return ServerError(f"{url} refused the request ({code}): give its key with {key_option} VAR", code)
    if code == 404:
        return ServerError(f"{url} does not exist on this server (404): check --api (llama, completions, chat)", 404)
    return ServerError(f"{url} answered {code}: {' '.join(detail.split())}", code)


def _retry_after(answer: httpx2.Response) -> float | None:
    value = answer.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__
