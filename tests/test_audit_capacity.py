"""What a KV setting buys (`audit/kv_capacity.py`): a server's declared KV cache beside kvevict's arithmetic.

The declared side is a `/metrics` page captured from vLLM 0.32.0's CPU build serving SmolLM2 with 1 GiB of KV
(`fixtures/vllm_metrics_fp32.txt`); the arithmetic is worked by hand here (a SmolLM2 token: 30 layers x 3 KV
heads x 64 x 2 x 4 bytes = 46,080 in float32; a page of 128 tokens; 1 GiB holds 182 pages, 728 at 1 byte).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvevict.audit.client import Client, Endpoint
from kvevict.audit.kv_capacity import buys_line, declared, what_it_buys

METRICS = (Path(__file__).parent / "fixtures" / "vllm_metrics_fp32.txt").read_text()


def as_fp8(page: str) -> str:
    """The same page as vLLM declares it with --kv-cache-dtype fp8: 728 pages, 93,184 tokens (captured too)."""
    return (page.replace('cache_dtype="auto"', 'cache_dtype="fp8"')
            .replace('num_gpu_blocks="182"', 'num_gpu_blocks="728"')
            .replace('kv_cache_size_tokens="23296"', 'kv_cache_size_tokens="93184"'))


def test_the_declared_cache_is_read_off_the_gauge():
    found = declared(METRICS)
    assert (found.kv_dtype, found.block_size, found.blocks, found.memory, found.tokens) == (
        "auto", 128, 182, 2**30, 23_296)
    assert declared("# no vLLM here\nprocess_cpu_seconds_total 1.0\n") is None


@pytest.fixture
def metrics_server():
    """Servers on 127.0.0.1 answering GET /metrics with the page given (None: 404, as llama-server without
    --metrics); yields a function of the page that returns a server's URL."""
    servers = []

    def start(page: str | None) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                body = (page or "").encode()
                self.send_response(200 if page is not None and self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def client(url: str) -> Client:
    return Client(Endpoint(url, retries=0))


def test_fp8_buys_four_times_the_sequences_by_both_counts(metrics_server):
    """Against a twin or reference declaring float32 KV in the same memory, and against kvevict's arithmetic alone:
    93,184 / 23,296 = 4.00 either way, and every count agrees with the arithmetic."""
    fp8, f32 = metrics_server(as_fp8(METRICS)), metrics_server(METRICS)
    for others, source in (([client(f32)], f32), ([], "kvevict's arithmetic")):
        buys = what_it_buys(client(fp8), others, "smollm2-135m")
        assert buys.source == source
        assert (buys.deployment.declared.tokens, buys.deployment.arithmetic) == (93_184, 93_184)
        assert (buys.baseline.declared.tokens, buys.baseline.arithmetic) == (23_296, 23_296)
        assert buys.deployment.dtype == "fp8" and buys.baseline.dtype == "float32"
        line = buys_line(buys, 0.0021, "inside")
        assert line == ("fp8 KV: KL 0.0021, inside; 4.00x the sequences of float32 KV (93,184 KV tokens in 1.000 GiB "
                        "against 23,296; kvevict's arithmetic: 93,184 and 23,296)")


def test_an_unquantized_deployment_is_its_own_baseline(metrics_server):
    buys = what_it_buys(client(metrics_server(METRICS)), [], "smollm2-135m")
    assert buys.source == "the deployment" and buys.deployment == buys.baseline
    line = buys_line(buys, 5e-12, "inside")
    assert line.startswith("float32 KV: KL 5e-12, inside; 1.00x the sequences of float32 KV")


def test_a_server_that_declares_otherwise_is_told_apart(metrics_server):
    """A cache declared as fp8 that holds what 2 bytes an element would (46,592 tokens): the line says the counts
    differ; a server with no /metrics declares nothing and the audit says nothing of capacity."""
    odd = METRICS.replace('cache_dtype="auto"', 'cache_dtype="fp8"').replace('kv_cache_size_tokens="23296"',
                                                                             'kv_cache_size_tokens="46592"')
    buys = what_it_buys(client(metrics_server(odd)), [], "smollm2-135m")
    assert not buys.deployment.agrees
    assert "differ" in buys_line(buys, 0.002, "inside")
    assert what_it_buys(client(metrics_server(None)), [], "smollm2-135m") is None
