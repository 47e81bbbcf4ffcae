"""`kvevict audit` as a team runs it against production, on `audit_fake.FakeServer` (loopback only): a key never
leaves the server it was named for, a reconfigured server is never judged by its old answers, the notes and
the advice speak of the engine actually audited, a loss with no eviction point is judged over the whole stream
against a twin's floor, and the verdict can stop CI.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from audit_fake import LADDER, FakeConfig, FakeServer
from kvevict.audit.client import Client, Endpoint
from kvevict.audit.run import run_audit
from kvevict.cli import app
from kvevict.errors import KvevictError
from kvevict.loading import load_tokenizer
from test_audit import _spec

STREAM = ["--prompt-tokens", "16", "--new-tokens", "200", "--retries", "0"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def _cli(args: list[str]):
    return CliRunner().invoke(app, ["audit", *args])


def _one_line(args: list[str], pattern: str) -> None:
    found = _cli(args)
    assert found.exit_code == 2, found.output
    assert len(found.output.strip().splitlines()) == 1 and pattern in found.output, found.output


def _generations(server: FakeServer) -> int:
    """Generation requests (more than the one token a reference position asks) the fake answered."""
    return sum(1 for path, body, _ in server.cfg.requests if path in ("/completion", "/v1/completions")
               and (body.get("n_predict") or body.get("max_tokens") or 0) > 1)


# --- credentials: redirects and keys -----------------------------------------------------------------------


def test_a_redirect_to_another_origin_is_refused_and_the_key_never_arrives(tokenizer, tmp_path, monkeypatch):
    """The deployment answers 307 to the same machine under another name (localhost, another port): refused in one
    line, and the other origin receives nothing at all, so no Authorization header either."""
    monkeypatch.setenv("AUDIT_DEP_KEY", "dep-secret")
    with FakeServer(FakeConfig(), tokenizer) as other:
        port = other.url.rsplit(":", 1)[1]
        with FakeServer(FakeConfig(redirect=f"http://localhost:{port}"), tokenizer) as dep:
            found = _cli([dep.url, "--api-key-env", "AUDIT_DEP_KEY", "--out", str(tmp_path), *STREAM])
            client = Client(Endpoint(dep.url, api_key_env="AUDIT_DEP_KEY", retries=0))
            with pytest.raises(KvevictError) as posted:
                client.post("/completion", {"prompt": [1, 2], "n_predict": 1})
        assert [(path, h.get("Authorization")) for path, _, h in other.cfg.requests] == []
    assert dep.cfg.requests[0][2].get("Authorization") == "Bearer dep-secret"  # it went where it was named
    assert found.exit_code == 2 and len(found.output.strip().splitlines()) == 1, found.output
    assert f"a redirect to http://localhost:{port}/props: the audit follows no redirect" in found.output
    assert "follows no redirect" in str(posted.value)


def test_each_server_gets_only_its_own_key(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("AUDIT_DEP_KEY", "dep-secret")
    monkeypatch.setenv("AUDIT_REF_KEY", "ref-secret")
    with FakeServer(FakeConfig(key="dep-secret"), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, key="ref-secret"), tokenizer) as ref:
        found = _cli([dep.url, "--reference-url", ref.url, "--api-key-env", "AUDIT_DEP_KEY",
                      "--reference-api-key-env", "AUDIT_REF_KEY", "--sinks", "0", "--out", str(tmp_path), *STREAM])
    assert found.exit_code == 0, found.output
    assert {h.get("Authorization") for _, _, h in dep.cfg.requests} == {"Bearer dep-secret"}
    assert {h.get("Authorization") for _, _, h in ref.cfg.requests} == {"Bearer ref-secret"}
    written = "".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())
    assert "secret" not in written


@pytest.mark.parametrize("url", ["http://203.0.113.5:8080", "http://inference.example.com", "http://[2001:db8::1]:80"])
def test_a_key_over_plain_http_beyond_loopback_is_refused_before_any_request(tmp_path, monkeypatch, url):
    """One line naming the fix, before any connection (the suite's network guard fails a test that tries one)."""
    monkeypatch.setenv("AUDIT_DEP_KEY", "dep-secret")
    _one_line([url, "--api-key-env", "AUDIT_DEP_KEY", "--out", str(tmp_path)],
              "unencrypted (http://): use https://, or pass --allow-plain-http-key")
    _one_line(["http://127.0.0.1:9", "--reference-url", url, "--reference-api-key-env", "AUDIT_DEP_KEY",
               "--out", str(tmp_path)], "--reference-api-key-env AUDIT_DEP_KEY: the key would cross the network")


@pytest.mark.parametrize("url,allowed", [
    ("http://127.0.0.1:8080", True), ("http://127.9.9.9:8080", True), ("http://[::1]:8080", True),
    ("http://localhost:8080", True), ("https://inference.example.com", True), ("http://10.0.0.7:8080", False),
    ("http://127.0.0.1.example.com", False), ("http://localhost.example.com", False),
])
def test_plain_http_takes_a_key_on_loopback_only_unless_allowed_in_so_many_words(url, allowed):
    if allowed:
        Endpoint(url, api_key_env="K")
    else:
        with pytest.raises(KvevictError, match="unencrypted"):
            Endpoint(url, api_key_env="K")
        Endpoint(url, api_key_env="K", allow_plain_http_key=True)
    Endpoint(url)  # no key: nothing to protect


@pytest.mark.parametrize("cfg_key,args,pattern", [
    (None, ["--reference-api-key-env", "AUDIT_UNSET_KEY"],
     "--reference-api-key-env AUDIT_UNSET_KEY: that environment variable is not set"),
    ("ref-secret", [], "refused the request (401): give its key with --reference-api-key-env VAR"),
])
def test_the_references_key_problems_name_its_own_option(tokenizer, tmp_path, monkeypatch, cfg_key, args, pattern):
    monkeypatch.delenv("AUDIT_UNSET_KEY", raising=False)
    with FakeServer(FakeConfig(), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024, key=cfg_key), tokenizer) as ref:
        _one_line([dep.url, "--reference-url", ref.url, "--out", str(tmp_path), *STREAM, *args], pattern)


# --- records and the server behind them --------------------------------------------------------------------


def test_a_restarted_server_with_another_keep_is_not_judged_by_its_old_answers(tokenizer, tmp_path):
    """llama-server --keep 0 audited, restarted at the same URL with --keep 4 (which llama-server does not report:
    the user says it with --server-keep), audited again into the same folder: a fresh generation, a fresh verdict."""
    with FakeServer(FakeConfig(n_ctx=128, keep=0), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        before = run_audit(_spec(dep.url, tmp_path, ref.url, sinks=0, server_keep=0))
        dep.cfg.keep = 4
        after = run_audit(_spec(dep.url, tmp_path, ref.url, sinks=0, server_keep=4))
    assert before.deployed.verdict.outcome == "outside"
    assert after.deployed.verdict.outcome == "inside" and after.deployed.verdict.after.kl == 0
    assert _generations(dep) == 2
    assert any("declared server keep 0 -> 4" in n and "none was replayed" in n for n in after.notes)


def test_a_reported_change_at_the_same_url_is_recorded_apart(tokenizer, tmp_path):
    """The context the server reports changes between runs: the first generation is not replayed for the second."""
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        run_audit(_spec(dep.url, tmp_path, ref.url, sinks=0))
        dep.cfg.n_ctx = 160
        again = run_audit(_spec(dep.url, tmp_path, ref.url, sinks=0))
        generations = _generations(dep)
        dep.cfg.n_ctx, dep.cfg.build = 160, "b11435-cpu"
        third = run_audit(_spec(dep.url, tmp_path, ref.url, sinks=0))
    assert generations == 2 and _generations(dep) == 3
    assert again.deployed.verdict.events[0] == 160 - 16 and again.deployed.generation.truncated is True
    assert any("n_ctx 128 -> 160" in n for n in again.notes)
    assert any("build_info b11434-cpu -> b11435-cpu" in n for n in third.notes)


def test_vllm_reruns_resume_although_its_listing_changes_per_request(tokenizer, tmp_path):
    """vLLM's /v1/models `created` and /metrics block count change per request; they are no part of its identity,
    so a rerun sends nothing twice; its KV dtype is, so an fp8 restart is recorded apart."""
    with FakeServer(FakeConfig(n_ctx=512, kind="vllm"), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, kind="vllm"), tokenizer) as ref:
        first = run_audit(_spec(dep.url, tmp_path, ref.url, route="completions"))
        sent = len(ref.cfg.requests)
        again = run_audit(_spec(dep.url, tmp_path, ref.url, route="completions"))
        completions = [p for p, _, _ in ref.cfg.requests[sent:] if p == "/v1/completions"]
        assert _generations(dep) == 1 and completions == []
        dep.cfg.kv_type, dep.cfg.kv_loss = "fp8", 0.3
        fp8 = run_audit(_spec(dep.url, tmp_path, ref.url, route="completions"))
    assert again.summary()["deployed"]["kl"] == first.summary()["deployed"]["kl"] == 0
    assert _generations(dep) == 2 and fp8.deployed.verdict.after.kl > 0.05
    assert fp8.server.identity.fact("cache_dtype") == "fp8"
    assert any("cache_dtype auto -> fp8" in n for n in fp8.notes)


# --- advice and notes that speak of the engine audited ------------------------------------------------------


def test_no_sink_advice_where_there_was_no_step(tokenizer, tmp_path):
    """A server that keeps the first token through its shifts (Gemma 3 on llama-server keeps its BOS) shows no
    step: no rerun is sent and no line advises keeping the sinks."""
    with FakeServer(FakeConfig(n_ctx=128, keep=1), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        found = _cli([dep.url, "--reference-url", ref.url, "--server-keep", "1", "--out", str(tmp_path), *STREAM])
    assert found.exit_code == 0, found.output
    assert "as deployed: inside" in found.output
    assert "removes the step" not in found.output and "set n_keep" not in found.output
    assert _generations(dep) == 1  # no rerun with the sinks kept
    assert json.loads((tmp_path / "audit.json").read_text())["effect"] == "no-step"


@pytest.mark.parametrize("kind,engine", [("vllm", "vLLM"), ("openai", "an OpenAI-compatible server")])
def test_notes_speak_of_the_engine_audited_and_say_it_never_evicted(tokenizer, tmp_path, kind, engine):
    with FakeServer(FakeConfig(n_ctx=512, kind=kind), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, kind=kind), tokenizer) as ref:
        found = _cli([dep.url, "--reference-url", ref.url, "--api", "completions", "--out", str(tmp_path), "--json",
                      *STREAM])
    assert found.exit_code == 0, found.output
    text = "\n".join(found.output.splitlines()[:-1])
    assert text.startswith(f"server: {engine}")
    assert "--keep" not in text and "llama-server" not in text and "shift" not in text
    assert "this server never evicted" in text
    summary = json.loads(found.output.splitlines()[-1])
    assert summary["server"]["engine"] == kind and summary["deployed"]["events"] == []
    assert not [b for p, b, _ in dep.cfg.requests if "n_keep" in (b or {})]  # no llama-server field sent


# --- a loss with no eviction point: the whole stream, the floor from a twin -------------------------------------


def _ladder_kl(loss: float) -> float:
    """KL(reference ‖ deployment) of the fake's two ladders by hand: 20 reported ids with the same top-1, and one
    rest cell each for the unreported mass."""
    p = np.exp(LADDER)
    q = np.exp([LADDER[0] - loss] + [lp + loss / 4 for lp in LADDER[1:]])
    cells_p, cells_q = np.append(p, 1 - p.sum()), np.append(q, max(0.0, 1 - q.sum()))
    return float(sum(a * math.log(a / b) for a, b in zip(cells_p, cells_q, strict=True)))


def test_a_loss_everywhere_is_judged_whole_against_a_twins_floor(tokenizer, tmp_path):
    """vLLM with a lossy KV cache and no eviction: the whole stream judged from token 0 (auto), the floor from a twin
    (a second unquantized vLLM), and the loss's own KL, computed by hand, set against it."""
    with FakeServer(FakeConfig(n_ctx=512, kind="vllm", kv_loss=0.3, kv_type="fp8"), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, kind="vllm"), tokenizer) as ref, \
            FakeServer(FakeConfig(n_ctx=1024, kind="vllm"), tokenizer) as twin:
        spec = _spec(dep.url, tmp_path, ref.url, route="completions")
        result = run_audit(spec.__class__(**{**spec.__dict__, "floor": Endpoint(twin.url, backoff=0.0)}))
    v = result.deployed.verdict
    assert v.judge == "whole" and v.events == () and (v.after.start, v.after.stop) == (0, 200)
    assert v.floor_source == "twin" and v.floor.kl == 0 and result.floor.verdict.outcome == "inside"
    assert v.after.kl == pytest.approx(_ladder_kl(0.3), rel=1e-9) and v.above_floor and v.outcome == "outside"
    assert _generations(twin) == 1


def test_without_a_twin_the_whole_stream_has_no_floor(tokenizer, tmp_path):
    """No twin: no floor, said as such, never the loss's own first tokens presented as one."""
    with FakeServer(FakeConfig(n_ctx=512, kind="vllm", kv_loss=0.3), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, kind="vllm"), tokenizer) as ref:
        found = _cli([dep.url, "--reference-url", ref.url, "--api", "completions", "--out", str(tmp_path), *STREAM])
    summary = json.loads((tmp_path / "audit.json").read_text())["deployed"]
    assert summary["floor"] is None and summary["floor_source"] is None and summary["judge"] == "whole"
    assert "no A/A floor, as no twin was given (--floor-url)" in found.output


def test_judge_whole_on_llama_server_judges_from_the_first_token(tokenizer, tmp_path):
    """A quantized llama-server that also shifts: --judge whole judges every token; the tokens before the first
    shift already carry the loss, so they are no floor."""
    with FakeServer(FakeConfig(n_ctx=128, keep=4, kv_loss=0.3), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        result = run_audit(_spec(dep.url, tmp_path, ref.url, server_keep=4, judge="whole"))
        events = run_audit(_spec(dep.url, tmp_path / "events", ref.url, server_keep=4))
    v = result.deployed.verdict
    assert v.events[0] == 128 - 16 and v.after.start == 0 and v.floor is None
    assert v.judgements[0][1].estimate == pytest.approx(_ladder_kl(0.3), rel=1e-9)
    assert events.deployed.verdict.floor.kl == pytest.approx(_ladder_kl(0.3), rel=1e-9)  # what the prefix floor holds


# --- the exit status for CI --------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_on,code", [(None, 0), ("outside", 3), ("undecided", 3)])
def test_fail_on_an_outside_verdict(tokenizer, tmp_path, fail_on, code):
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        found = _cli([dep.url, "--reference-url", ref.url, "--out", str(tmp_path), "--sinks", "0", *STREAM,
                      *(["--fail-on", fail_on] if fail_on else [])])
    assert found.exit_code == code, found.output
    assert "as deployed: outside" in found.output and (tmp_path / "report.html").exists()


@pytest.mark.parametrize("fail_on,code", [("outside", 0), ("undecided", 3)])
def test_fail_on_undecided_counts_an_undecided_task(tokenizer, tmp_path, fail_on, code):
    """Two conversations are too few prompts to bound an accuracy drop: undecided, which only --fail-on undecided
    stops on."""
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        found = _cli([dep.url, "--reference-url", ref.url, "--api", "chat", "--conversations", "2", "--out",
                      str(tmp_path), "--fail-on", fail_on, "--retries", "0"])
    assert found.exit_code == code, found.output
    assert json.loads((tmp_path / "audit.json").read_text())["outcome"] == "undecided"


# --- the local reference's dtype and device -----------------------------------------------------------------


def test_the_local_reference_runs_in_the_dtype_asked(tokenizer, tmp_path, tiny_dir):
    """--dtype bfloat16: the local reference's weights are bfloat16, as read back from the model it loaded (left
    out: float32 on the CPU)."""
    from kvevict.audit.run import LocalModel

    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep:
        run = _cli([dep.url, "--model", str(tiny_dir), "--dtype", "bfloat16", "--device", "cpu", "--sinks", "0",
                    "--out", str(tmp_path), "--json", *STREAM])
    assert run.exit_code == 0, run.output
    found = json.loads(run.output.splitlines()[-1])["reference"]
    assert found == {"kind": "local", "model": str(tiny_dir), "device": "cpu", "dtype": "bfloat16"}
    default = LocalModel(str(tiny_dir))
    default.get()
    assert default.describe()["dtype"] == "float32"


# --- bad input: one line, exit 2 ----------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,args,pattern", [
    (FakeConfig(n_ctx=512, kind="vllm"), ["--api", "completions", "--judge", "after-event"],
     "--judge after-event needs an eviction event, and vLLM declares none: give --context N"),
    (FakeConfig(n_ctx=200, kind="vllm"), ["--api", "completions"],
     "run past the deployment's 200-token context, which it does not evict from (it refuses the request): use "
     "--new-tokens 184 or fewer"),
    (FakeConfig(n_ctx=512, kind="vllm"), ["--api", "completions", "--new-tokens", "20"],
     "--new-tokens 20 is too few to judge"),
    (FakeConfig(), ["--judge", "sometimes"], "--judge must be one of auto, after-event, whole, got 'sometimes'"),
    (FakeConfig(), ["--fail-on", "always"], "--fail-on must be one of never, outside, undecided, got 'always'"),
    (FakeConfig(), ["--dtype", "float8"], "--dtype must be one of"),
    (FakeConfig(), ["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (FakeConfig(), ["--api", "chat", "--conversations", "1", "--floor-url", "http://127.0.0.1:9"],
     "--floor-url gives the fidelity stream's A/A floor, and --api chat runs no stream"),
])
def test_new_bad_input_is_one_line(tokenizer, tmp_path, cfg, args, pattern):
    with FakeServer(cfg, tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024, kind=cfg.kind), tokenizer) as ref:
        _one_line([dep.url, "--reference-url", ref.url, "--out", str(tmp_path), *STREAM, *args], pattern)


def test_a_twin_that_would_evict_is_refused(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=512, kind="vllm", kv_loss=0.3), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, kind="vllm"), tokenizer) as ref, \
            FakeServer(FakeConfig(n_ctx=128, kind="vllm"), tokenizer) as twin:
        _one_line([dep.url, "--reference-url", ref.url, "--floor-url", twin.url, "--api", "completions",
                   "--out", str(tmp_path), *STREAM],
                  "the twin's context (128 tokens) is shorter than the workload's 216: it would evict too; start it "
                  "with a context of at least 217 (vLLM --max-model-len)")
