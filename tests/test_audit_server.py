"""`kvevict audit` against llama.cpp's own llama-server on loopback, serving the embedded SmolLM2 GGUF three ways:
a reference with a large context, `--ctx-size 256 --keep 0` and `--ctx-size 256 --keep 4` (`make test-audit`);
and with its quantized KV (`--cache-type-k/-v q4_0`, rotated and not), one server at a time.

What it must show: keep 0 judged outside with the sink-loss signature, and a rerun with n_keep 4 shrinking the
step; keep 4 a smaller step than keep 0; two identical servers judged inside; the audit's fidelity loss on the
deployment's own tokens agreeing with kvevict's `llamacpp` preset (`audit/reproduction.py` states the
tolerance); the OpenAI-compatible `/v1/completions` route reading the same stream. With quantized KV: a quantized V
refused without flash attention, a quantized K served without it; the loss judged over the whole stream above the
twin's floor; llama.cpp's rotation cutting it, outside and in kvevict's `q4_0` forms alike, each within the
reproduction's tolerance; the KV bytes llama-server logs equal to kvevict's capacity arithmetic.
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


# --- llama.cpp's quantized KV: a loss with no eviction point, judged over the whole stream ----------------------

QUANT_NEW = 224  # generated tokens: 14 bootstrap blocks, inside the reference's context of 1024


def _kv_halves_mib(model, kv_type: str, cells: int) -> float:
    """kvevict's capacity arithmetic for one half (K or V) of `cells` tokens held as `kv_type` (llama.cpp's
    name), in MiB."""
    from kvevict.capacity import element_bytes_of, shape_of

    dtype = {"f16": "float16", "f32": "float32"}.get(kv_type, kv_type)
    return shape_of(model.config, element_bytes_of(dtype)).sequence_bytes(cells) / 2 / 2**20


def _logged_kv_agrees(log, model) -> tuple[str, str]:
    """llama-server's own KV bytes (its log line) against kvevict's arithmetic at its context, each half to the
    log's 2 decimals; returns the (K, V) types it logged."""
    from kvevict.audit.server_log import kv_cache_size

    found = kv_cache_size(log.read_text(errors="replace"))
    assert len(found) == 1, found
    kv = found[0]
    assert (kv.cells, kv.layers) == (1024, model.config.num_hidden_layers)
    for kind, mib in ((kv.k_type, kv.k_mib), (kv.v_type, kv.v_mib)):
        assert mib == pytest.approx(_kv_halves_mib(model, kind, kv.cells), abs=0.005), (kind, kv)
    return kv.k_type, kv.v_type


def test_a_quantized_v_needs_flash_attention_and_a_quantized_k_does_not(tmp_path, local):
    """llama.cpp refuses a quantized V without flash attention (src/llama-context.cpp: `-fa off` is an error,
    `auto` turns it on); a quantized K alone serves with it off, and is still rotated (n_rot_k = 64)."""
    from kvevict.errors import KvevictError

    gguf = embedded_gguf("smollm2-135m")
    with pytest.raises(KvevictError, match="exited"):
        with llama_server(gguf, 1024, cache_type_v="q8_0", flash_attn="off", log=tmp_path / "v.log"):
            pass
    assert "quantized V cache requires flash_attn" in (tmp_path / "v.log").read_text(errors="replace")
    with llama_server(gguf, 1024, cache_type_k="q8_0", flash_attn="off", log=tmp_path / "k.log", verbosity=4):
        pass
    log = (tmp_path / "k.log").read_text(errors="replace")
    assert "flash_attn            = disabled" in log and "n_rot_k = 64" in log and "n_rot_v = 0" in log
    assert _logged_kv_agrees(tmp_path / "k.log", local.get()) == ("q8_0", "f16")


@pytest.fixture(scope="module")
def kvquant(tmp_path_factory, local):
    """q4_0 K and V with llama.cpp's rotation and without it (`LLAMA_ATTN_ROT_DISABLE=1`), one server at a time,
    each audited over the whole stream against an f16 reference (its own twin for the floor: an identical
    server), each beside kvevict's form of the same type on the same tokens."""
    from kvevict.audit.reproduction import spec_fidelity

    gguf = embedded_gguf("smollm2-135m")
    out, found = tmp_path_factory.mktemp("kvquant"), {}
    with llama_server(gguf, 1024, log=out / "reference.log") as reference:
        for spec, env in (("q4_0+full", {}), ("q4_0:rot=none+full", {"LLAMA_ATTN_ROT_DISABLE": "1"})):
            log = out / f"{spec}.log"
            with llama_server(gguf, 1024, cache_type_k="q4_0", cache_type_v="q4_0", env=env, log=log,
                              verbosity=4) as url:
                audit = run_audit(AuditSpec(deployment=Endpoint(url), reference=Endpoint(reference),
                                            floor=Endpoint(reference), judge="whole", new_tokens=QUANT_NEW, sinks=0,
                                            out=out / "audit"))
            found[spec] = (audit, spec_fidelity(local.get(), audit.deployed, spec), log)
    return found


def test_quantized_kv_is_judged_over_the_whole_stream_against_the_twins_floor(kvquant, local):
    for spec, (audit, _, log) in kvquant.items():
        v = audit.deployed.verdict
        assert v.events == () and audit.deployed.generation.truncated is False, spec
        assert audit.floor is not None and audit.floor.series["kl"].max() == 0.0, spec  # identical servers
        assert v.floor.kl == 0.0 and v.after.start == 0 and v.after.stop == QUANT_NEW, spec
        assert v.above_floor, spec  # the quantized cache's loss lies beyond the two servers' arithmetic
        assert _logged_kv_agrees(log, local.get()) == ("q4_0", "q4_0"), spec


def test_llamacpps_rotation_is_what_kvevicts_form_reproduces(kvquant):
    """Outside, llama-server's rotated q4_0 loses less than its unrotated q4_0, and inside kvevict's forms of the
    same two lose the same way, each within the reproduction's tolerance of the audit (`Reproduction.agrees`:
    the audit's top-k KL a lower bound of the full KL, between a third of it and 1.25x it plus 1e-4 nats;
    top-1 disagreement within 0.05)."""
    from kvevict.audit.reproduction import Reproduction

    kl = {}
    for spec, (audit, (inside_kl, inside_miss), _) in kvquant.items():
        series = audit.deployed.series
        found = Reproduction(spec=spec, shifts_audit=(), shifts_kvevict=(),
                             disagree_audit=float(series["disagree"].mean()),
                             disagree_kvevict=float(inside_miss.mean()), kl_audit=float(series["kl"].mean()),
                             kl_kvevict=float(inside_kl.mean()), floor_disagree=0.0)
        assert found.agrees(), (spec, found.as_dict())
        kl[spec] = (found.kl_audit, found.kl_kvevict)
    rotated, plain = kl["q4_0+full"], kl["q4_0:rot=none+full"]
    assert rotated[0] < plain[0] / 2 and rotated[1] < plain[1] / 2, kl
