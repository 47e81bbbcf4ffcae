"""`kvevict audit` against llama.cpp's own llama-server on loopback, serving the embedded SmolLM2 GGUF three ways:
a reference with a large context, `--ctx-size 256 --keep 0` and `--ctx-size 256 --keep 4` (`make test-audit`).

What it must show: keep 0 judged outside with the sink-loss signature, and a rerun with n_keep 4 shrinking the
step; keep 4 a smaller step than keep 0; two identical servers judged inside; the audit's fidelity loss on the
deployment's own tokens agreeing with kvevict's `llamacpp` preset (`audit/reproduction.py` states the
tolerance); the OpenAI-compatible `/v1/completions` route reading the same stream.
"""

from __future__ import annotations

import pytest

from kvevict.audit.client import Endpoint
from kvevict.audit.llama_launch import binary, llama_server
from kvevict.audit.reproduction import reproduce
from kvevict.audit.run import AuditSpec, LocalModel, run_audit
from kvevict.loading.gguf import embedded_gguf

pytestmark = [
    pytest.mark.llama_server,
    pytest.mark.skipif(not binary().exists(), reason=f"no llama-server at {binary()}: run make llama-server"),
]

CTX = 256


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    gguf = embedded_gguf("smollm2-135m")
    logs = tmp_path_factory.mktemp("logs")
    with llama_server(gguf, 1024, log=logs / "ref.log") as ref, \
            llama_server(gguf, 1024, log=logs / "twin.log") as twin, \
            llama_server(gguf, CTX, keep=0, log=logs / "keep0.log") as keep0, \
            llama_server(gguf, CTX, keep=4, log=logs / "keep4.log") as keep4:
        yield {"ref": ref, "twin": twin, "keep0": keep0, "keep4": keep4, "logs": logs}


@pytest.fixture(scope="module")
def local():
    return LocalModel("smollm2-135m")


def _audit(url: str, reference: str | None, out, route: str = "llama", local=None, keep: int = 0,
           context: int | None = None):
    spec = AuditSpec(deployment=Endpoint(url), reference=Endpoint(reference) if reference else None, route=route,
                     server_keep=keep, context=context, sinks=0 if context else 4, out=out)
    return run_audit(spec, local)


@pytest.fixture(scope="module")
def audits(servers, tmp_path_factory):
    out = tmp_path_factory.mktemp("audits")
    # the twin never evicts: it is audited as if its context were 256, so the floor and the window after the
    # first (declared) event are both measured, and both must be inside
    return {name: _audit(servers[name], servers["ref"], out / name, keep=4 if name == "keep4" else 0,
                         context=CTX if name == "twin" else None)
            for name in ("keep0", "keep4", "twin")}


def test_keep_0_is_outside_with_the_sink_loss_signature(audits, servers):
    found = audits["keep0"]
    v = found.deployed.verdict
    assert found.server.n_ctx == CTX
    assert v.events[0] == CTX - 32  # the 32-token prompt fills the context at generated token 224
    assert found.deployed.generation.truncated is True
    assert "slot context shift" in (servers["logs"] / "keep0.log").read_text(errors="replace")
    assert v.outcome == "outside" and v.signature
    assert found.rerun is not None and found.effect in ("gone", "smaller")


def _logged_shifts(log) -> list[tuple[int, int]]:
    """(n_keep, n_discard) of every "slot context shift" line llama-server logged."""
    import re

    shift = r"slot context shift, n_keep = (\d+), n_left = \d+, n_discard = (\d+)"
    found = re.findall(shift, log.read_text(errors="replace"))
    return [(int(a), int(b)) for a, b in found]


def test_keep_4_steps_less_than_keep_0(audits, servers):
    k0, k4 = audits["keep0"].deployed.verdict, audits["keep4"].deployed.verdict
    assert k4.events[0] == k0.events[0]
    logged = _logged_shifts(servers["logs"] / "keep4.log")  # the server's own account of its shifts
    assert logged and {keep for keep, _ in logged} == {4}
    gaps = [b - a for a, b in zip(k4.events, k4.events[1:], strict=False)]
    assert gaps == [discard for _, discard in logged][: len(gaps)]
    assert k4.after.kl_interval.high < k0.after.kl_interval.low
    assert k4.after.disagree < k0.after.disagree


def test_two_identical_servers_are_inside(audits):
    found = audits["twin"]
    v = found.deployed.verdict
    assert v.outcome == "inside", v.as_dict()
    assert not v.step and not v.signature
    assert found.deployed.generation.truncated is False  # it never shifted, and says so
    assert any("truncated=false" in note for note in found.notes)


def test_the_audit_agrees_with_the_reproduction(audits, local):
    """The llamacpp preset on the deployment's own tokens: same shifts, loss of the same size (reproduction.py)."""
    for name in ("keep0", "keep4"):
        found = reproduce(local.get(), audits[name].deployed)
        assert found.agrees(), (name, found.as_dict())


def test_kvevicts_full_cache_as_the_reference(servers, tmp_path, local):
    found = _audit(servers["keep0"], None, tmp_path, local=local)
    v = found.deployed.verdict
    assert v.signature and v.outcome == "outside"
    assert v.floor.kl < v.after.kl_interval.low  # the arithmetic floor is far below the loss


def test_the_openai_route_reads_the_same_stream(servers, audits, tmp_path):
    found = _audit(servers["keep0"], servers["ref"], tmp_path, route="completions")
    assert found.deployed.tokens == audits["keep0"].deployed.tokens
    assert found.deployed.verdict.outcome == "outside"
