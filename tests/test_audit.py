"""`kvevict audit` without a real server: the client's manners, the per-token fidelity against an independent
computation, llama-server's shift arithmetic, resumption, and every bad input (one line, exit 2).

The server is `audit_fake.FakeServer` on 127.0.0.1: llama-server's routes over a synthetic model whose
distribution changes once the first token leaves the cache.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from audit_fake import FakeConfig, FakeServer
from kvevict.audit.api import Ask, Step, generate
from kvevict.audit.client import Client, Endpoint
from kvevict.audit.events import effective_keep, shift_steps
from kvevict.audit.fidelity import TopK, kl_topk
from kvevict.audit.run import AuditSpec, run_audit
from kvevict.cli import app
from kvevict.errors import KvevictError
from kvevict.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def _spec(url: str, tmp_path: Path, reference: str | None, **kw) -> AuditSpec:
    settings = {"backoff": 0.0, "retries": 3}
    kw = {"prompt_tokens": 16, "new_tokens": 200, **kw}
    return AuditSpec(deployment=Endpoint(url, **settings), reference=reference and Endpoint(reference, **settings),
                     out=tmp_path, **kw)


# --- the shift arithmetic against a simulation of llama-server's slot --------------------------------------


@pytest.mark.parametrize("prompt,n_ctx,keep", [(16, 128, 0), (16, 128, 4), (40, 64, 1), (5, 32, 30)])
def test_shift_steps_match_a_simulated_slot(prompt, n_ctx, keep):
    """The events are where the fake slot (a list of held tokens, shifted as `pre_decode` does) shifted."""
    from audit_fake import generate as slot

    cfg = FakeConfig(n_ctx=n_ctx)
    kept = effective_keep(keep, prompt, n_ctx, add_bos=False)
    entries, _ = slot(cfg, list(range(100, 100 + prompt)), 300, 1, kept)
    held, seen = prompt, []  # independent replay: count held tokens, note each generated index after a shift
    for j in range(1, 300):
        if held + 1 >= n_ctx:
            held -= max(0, min((held - kept) // 2, held - kept - 1))
            seen.append(j)
        held += 1
    assert shift_steps(prompt, 300, n_ctx, kept) == seen
    assert seen and seen[0] == n_ctx - prompt


def test_effective_keep_follows_llama_server():
    assert effective_keep(0, 16, 256, add_bos=True) == 1  # BOS: one more
    assert effective_keep(-1, 16, 256, add_bos=False) == 16  # -1: the whole prompt
    assert effective_keep(500, 16, 256, add_bos=False) == 252  # at most n_ctx - 4


# --- the top-k KL against the full-vocabulary KL it approximates ------------------------------------------


def test_topk_kl_is_exact_when_the_top_k_holds_the_mass_and_a_lower_bound_otherwise():
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = rng.dirichlet(np.full(30, 0.3))
        q = rng.dirichlet(np.full(30, 0.3))
        full = float((p * np.log(p / q)).sum())
        every = TopK(tuple(range(30)), tuple(np.log(p)))
        known = TopK(tuple(range(30)), tuple(np.log(q)))
        assert kl_topk(every, known)[0] == pytest.approx(full, rel=1e-9)
        # the reference exact (every id known), the deployment's top 8 only: coarse-grained, never above the full KL
        order = np.argsort(-q)[:8]
        partial = TopK(tuple(int(i) for i in order), tuple(float(np.log(q[i])) for i in order))
        ref = TopK(tuple(int(i) for i in np.argsort(-p)[:8]), tuple(float(np.log(np.sort(p)[::-1][i]))
                                                                     for i in range(8)),
                   tuple((i, float(np.log(p[i]))) for i in range(30)))
        lower, tail = kl_topk(ref, partial)
        assert 0 <= lower <= full + 1e-9
        union = set(ref.ids) | set(partial.ids)
        assert tail == pytest.approx(1 - sum(p[i] for i in union), abs=1e-9)


def test_topk_kl_by_hand_with_the_rest_cell():
    """ref {1: .6, 2: .3, rest .1}, deployment {1: .3, 2: .3, rest .4}: .6 ln 2 + .1 ln(.1 / .4)."""
    ref = TopK((1, 2), (math.log(0.6), math.log(0.3)))
    dep = TopK((1, 2), (math.log(0.3), math.log(0.3)))
    assert kl_topk(ref, dep)[0] == pytest.approx(0.6 * math.log(2) + 0.1 * math.log(0.25), rel=1e-12)


def test_a_step_within_the_kl_limit_is_no_signature():
    """A clear step at the first event whose window stays under --max-kl is a step, not the signature."""
    from kvevict.audit.judge import judge_stream
    from kvevict.stats.tolerance import Tolerance

    rng = np.random.default_rng(1)
    kl = np.concatenate([rng.uniform(0, 0.002, 96), rng.uniform(0.04, 0.06, 96)])
    dis = np.concatenate([np.zeros(96), (rng.uniform(size=96) < 0.3).astype(float)])
    series = {"kl": kl, "disagree": dis, "ref_nll": kl, "best_nll": kl}
    low = judge_stream(series, [96], Tolerance(max_kl=1.0))
    high = judge_stream(series, [96], Tolerance(max_kl=0.01))
    assert low.step and not low.signature
    assert high.step and high.signature and high.outcome == "outside"


def test_topk_kl_of_disjoint_top_k_is_large():
    a = TopK((1, 2), (math.log(0.6), math.log(0.3)))
    b = TopK((3, 4), (math.log(0.6), math.log(0.3)))
    assert kl_topk(a, b)[0] > 1.0


# --- the client -------------------------------------------------------------------------------------------


def test_retries_wait_out_503_and_429_and_count_every_request(tokenizer):
    slept = []
    with FakeServer(FakeConfig(busy=2, limited=1), tokenizer) as server:
        client = Client(Endpoint(server.url, backoff=0.25, retries=3), sleep=slept.append)
        assert client.get("/props")["default_generation_settings"]["n_ctx"] == 128
    assert client.sent == 4
    assert slept[0] >= 0.25 and slept[1] >= 0.5 and slept[2] < 0.1  # doubled, then Retry-After: 0


def test_retries_give_up_in_one_line(tokenizer):
    with FakeServer(FakeConfig(busy=10), tokenizer) as server:
        client = Client(Endpoint(server.url, backoff=0.0, retries=2), sleep=lambda s: None)
        with pytest.raises(KvevictError, match="answered 503"):
            client.get("/props")
    assert client.sent == 3


def test_the_key_is_sent_and_never_written(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("AUDIT_TEST_KEY", "s3cr3t-value")
    with FakeServer(FakeConfig(key="s3cr3t-value"), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024, key="s3cr3t-value"), tokenizer) as ref:
        settings = {"api_key_env": "AUDIT_TEST_KEY", "backoff": 0.0}
        spec = AuditSpec(deployment=Endpoint(dep.url, **settings), reference=Endpoint(ref.url, **settings),
                         prompt_tokens=16, new_tokens=200, out=tmp_path)
        run_audit(spec)
    written = "".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())
    assert "s3cr3t" not in written and "AUDIT_TEST_KEY" not in written
    assert all(h.get("Authorization") == "Bearer s3cr3t-value" for _, _, h in dep.cfg.requests)


def test_requests_in_flight_stay_within_concurrency(tokenizer):
    import threading
    import time

    live, most, lock = [0], [0], threading.Lock()

    def work(x):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.02)
        with lock:
            live[0] -= 1
        return x

    client = Client(Endpoint("http://127.0.0.1:9", concurrency=3))
    assert client.map(work, range(20)) == list(range(20))
    assert most[0] == 3


# --- the audit end to end on the synthetic model ----------------------------------------------------------


def test_keep_0_is_outside_with_the_signature_and_n_keep_removes_it(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=128, keep=0), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        result = run_audit(_spec(dep.url, tmp_path, ref.url))
    d = result.deployed
    assert d.verdict.events[0] == 128 - 16
    assert d.verdict.floor.kl == 0 and d.verdict.floor.disagree == 0  # the same model before the first shift
    assert d.verdict.outcome == "outside" and d.verdict.signature
    assert result.rerun is not None and result.rerun.plan.n_keep == 4
    assert result.rerun.verdict.outcome == "inside" and not result.rerun.verdict.step
    assert not result.rerun.verdict.signature
    assert result.effect == "gone"
    assert d.generation.truncated is True


def test_a_rerun_resumes_and_sends_nothing_twice(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        first = run_audit(_spec(dep.url, tmp_path, ref.url))
        sent = [len(dep.cfg.requests), len(ref.cfg.requests)]
        lines = (tmp_path / "results.jsonl").read_text().splitlines()
        (tmp_path / "results.jsonl").write_text("\n".join(lines[:-5]) + "\n" + lines[-5][:20])  # killed mid-write
        again = run_audit(_spec(dep.url, tmp_path, ref.url))
        generations = [p for p, b, _ in dep.cfg.requests if p == "/completion" and b["n_predict"] > 1]
        completions = [p for p, b, _ in ref.cfg.requests[sent[1]:] if p == "/completion"]
    assert len(generations) == 2  # as deployed and the rerun, once each
    assert len(completions) == 5  # only the five reference positions lost with the torn tail
    assert again.summary()["deployed"]["kl"] == first.summary()["deployed"]["kl"]


def test_completions_route_reads_the_same_stream(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        native = run_audit(_spec(dep.url, tmp_path / "a", ref.url))
        v1 = run_audit(_spec(dep.url, tmp_path / "b", ref.url, route="completions"))
    assert v1.deployed.tokens == native.deployed.tokens
    assert v1.deployed.verdict.outcome == native.deployed.verdict.outcome == "outside"


# --- bad input: one line, exit 2 --------------------------------------------------------------------------


def _cli(args: list[str]) -> tuple[int, str]:
    found = CliRunner().invoke(app, ["audit", *args])
    return found.exit_code, found.output


def _one_line(args: list[str], pattern: str) -> None:
    code, out = _cli(args)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and pattern in out, out


def test_non_http_scheme_is_one_line():
    _one_line(["ftp://127.0.0.1:8080"], "must be http:// or https://")


def test_unreachable_url_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _one_line([f"http://127.0.0.1:{port}", "--retries", "0", "--out", str(tmp_path)], "cannot reach")


@pytest.mark.parametrize("cfg,args,pattern", [
    (FakeConfig(logprobs=False), [], "returned no log-probabilities"),
    (FakeConfig(), ["--served-model", "llama-3-8b"], "not 'llama-3-8b'"),
    (FakeConfig(shift_tokenizer=True), [], "tokenizer disagrees"),
    (FakeConfig(n_ctx=40), ["--prompt-tokens", "16"], "too short"),
    (FakeConfig(n_ctx=128), ["--new-tokens", "50"], "nothing would be evicted"),
    (FakeConfig(key="the-key"), [], "refused the request (401): give its key with --api-key-env"),
])
def test_server_side_bad_input_is_one_line(tokenizer, tmp_path, cfg, args, pattern):
    with FakeServer(cfg, tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        _one_line([dep.url, "--reference-url", ref.url, "--prompt-tokens", "16", "--new-tokens", "200", "--retries",
                   "0", "--out", str(tmp_path), *args], pattern)


def test_a_reference_that_would_evict_is_refused(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=128), tokenizer) as ref:
        _one_line([dep.url, "--reference-url", ref.url, "--prompt-tokens", "16", "--new-tokens", "200",
                   "--out", str(tmp_path)], "would evict too")


def test_generate_parses_openai_legacy_logprobs_with_token_ids(tokenizer):
    """vLLM's legacy /v1/completions shape (`token_id:N` strings with return_tokens_as_token_ids)."""
    answer = {"choices": [{"text": "x", "logprobs": {"tokens": ["token_id:5", "token_id:9"],
                                                      "token_logprobs": [-0.1, -0.7],
                                                      "top_logprobs": [{"token_id:5": -0.1, "token_id:3": -2.5},
                                                                       {"token_id:2": -0.6, "token_id:9": -0.7}]}}]}

    class Fixed(Client):
        def post(self, path, body):
            assert body["return_tokens_as_token_ids"] is True and body["logprobs"] == 2
            return answer

    found = generate(Fixed(Endpoint("http://127.0.0.1:1")), "completions", Ask(n_predict=2, k=2, ids=(1, 2)))
    assert found.steps == (Step(5, -0.1, (5, 3), (-0.1, -2.5)), Step(9, -0.7, (2, 9), (-0.6, -0.7)))


def test_audit_json_holds_the_verdict(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        code, out = _cli([dep.url, "--reference-url", ref.url, "--prompt-tokens", "16", "--new-tokens", "200",
                          "--out", str(tmp_path), "--json"])
    assert code == 0, out
    found = json.loads(out.strip().splitlines()[-1])
    assert found["deployed"]["outcome"] == "outside" and found["effect"] == "gone"
    assert "sink-loss signature" in out
    assert (tmp_path / "report.html").exists()


def test_prompt_logprobs_scores_the_stream_in_one_request(tokenizer, tmp_path):
    """vLLM's prompt_logprobs as the reference: one request, the same fidelity as one request per position."""
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        per_position = run_audit(_spec(dep.url, tmp_path / "a", ref.url, sinks=0))
        before = len(ref.cfg.requests)
        one = run_audit(_spec(dep.url, tmp_path / "b", ref.url, sinks=0, reference_mode="prompt-logprobs"))
        scored = [b for p, b, _ in ref.cfg.requests[before:] if p == "/v1/completions"]
    assert len(scored) == 1
    # the same top-k at every position; prompt_logprobs also gives the deployment's own token where it ranks past k,
    # which moves the KL a little where that token was shared out of the tail
    np.testing.assert_allclose(one.deployed.series["kl"], per_position.deployed.series["kl"], rtol=1e-3)
    np.testing.assert_array_equal(one.deployed.series["disagree"], per_position.deployed.series["disagree"])
    assert one.deployed.verdict.outcome == per_position.deployed.verdict.outcome == "outside"


def test_the_local_reference_is_a_full_forward_teacher_forced():
    """kvevict's full cache as the reference: its top-k at every generated position is the plain forward's."""
    import torch

    from kvevict.audit.reference import local_reference

    from conftest import make_tiny

    model = make_tiny(seed=3)
    prompt = [5, 17, 42, 8, 99, 3]
    steps = [Step(t, -1.0, (t, 7), (-1.0, -2.0)) for t in (11, 64, 2, 2, 90)]
    found = local_reference(model, prompt, steps, k=4)
    ids = torch.tensor([prompt + [s.token for s in steps]])
    with torch.inference_mode():
        expected = model(ids).logits[0].double().log_softmax(-1)
    for j, ref in enumerate(found):
        row = expected[len(prompt) - 1 + j]
        top = torch.topk(row, 4)
        assert ref.ids == tuple(top.indices.tolist())
        np.testing.assert_allclose(ref.logprobs, top.values.numpy(), atol=1e-5)
        assert dict(ref.extra)[steps[j].token] == pytest.approx(float(row[steps[j].token]), abs=1e-5)


@pytest.mark.parametrize("keep", [0, 2])
def test_the_reproduction_shifts_where_the_audit_places_the_events(keep):
    """kvevict's `llamacpp` preset on the deployment's tokens evicts at the generated indices `events.py` places."""
    from kvevict.audit.api import Generation
    from kvevict.audit.fidelity import Point
    from kvevict.audit.judge import judge_stream
    from kvevict.audit.reproduction import reproduce
    from kvevict.audit.stream import StreamPlan, StreamResult
    from kvevict.stats.tolerance import Tolerance

    from conftest import make_tiny

    rng = np.random.default_rng(keep)
    plan = StreamPlan(tuple(int(x) for x in rng.integers(3, 100, 10)), 80, 4, 32, n_keep=keep)
    generation = Generation("", tuple(Step(int(t), -1.0, (int(t),), (-1.0,)) for t in rng.integers(3, 100, 80)),
                            True, 10)
    points = [Point(True, 1.0, 1.0, 0.0, 0.0)] * 80
    series = {"kl": np.zeros(80), "disagree": np.zeros(80), "ref_nll": np.ones(80), "best_nll": np.ones(80)}
    result = StreamResult("as deployed", plan, generation, points, judge_stream(series, plan.events(), Tolerance()),
                          series)
    found = reproduce(make_tiny(seed=5), result, chunk=4)
    assert found.shifts_kvevict == tuple(plan.events()) and len(found.shifts_kvevict) >= 3
    assert found.kl_kvevict > 0


def test_a_reference_that_would_stop_is_not_disagreed_with():
    """With ignore_eos the deployment may not choose the end of sequence: the reference's own choice is its best
    other id (here the deployment's), and the regret is measured against that choice."""
    from kvevict.audit.fidelity import end_ids, point

    ref = TopK((2, 40, 7), (math.log(0.5), math.log(0.3), math.log(0.1)))
    step = Step(40, math.log(0.3), (2, 40, 7), (math.log(0.5), math.log(0.3), math.log(0.1)))
    assert not point(ref, step).agree
    ended = point(ref, step, frozenset({2}))
    assert ended.agree and ended.best_nll == pytest.approx(-math.log(0.3)) and ended.kl == pytest.approx(0)
    assert 2 in end_ids(load_tokenizer("smollm2-135m")) and 0 in end_ids(load_tokenizer("smollm2-135m"))
