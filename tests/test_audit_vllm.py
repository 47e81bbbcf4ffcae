"""`kvevict audit` against vLLM's own server (its CPU build) on this machine, the second real engine (make test-audit).

Each vLLM runs in a network namespace of its own that holds only loopback (`netns.py`), listening on a Unix
socket that a loopback port here relays to (`audit/relay.py`): nothing it sends can leave the machine, whatever
its telemetry does. Two servers at a time, each on its own core, shared by a class's tests (a start costs
about 40 s on two idle cores): the embedded SmolLM2's converted float32 folder with a float32 KV cache and
with `--kv-cache-dtype fp8`; then with `fp8_e5m2`, beside Gemma 3 270M (sliding-window layers).

What it must show: the completions route read by token id, judged whole (vLLM declares no eviction); the
tokenizer checked through vLLM's `/tokenize`; a second vLLM scoring the whole stream in one request
(`prompt_logprobs`) with kvevict's own reference's top-20; float32 KV inside at the floor of arithmetic; fp8 KV
judged against its float32 twin and reproduced inside by vLLM's rule (`vllmfp8+full`,
`storage_forms/vllm_fp8.py`), not by kvevict's calibrated `fp8+full`; e5m2 by its own format alone; the capacity
each declares (`/metrics`, its log) equal to kvevict's arithmetic; the chat route carrying the tasks workload; a
prompt beyond `max_model_len` reported as refused; Gemma 3's sliding window applied as the model defines it.
"""

from __future__ import annotations

import re

import pytest

from kvevict.audit.client import Client, Endpoint
from kvevict.audit.fidelity import columns, point
from kvevict.audit.kv_capacity import capacity, declared
from kvevict.audit.probe import check_tokenizer
from kvevict.audit.reference import local_reference, prompt_logprobs_reference
from kvevict.audit.reproduction import reproduce
from kvevict.audit.run import AuditSpec, LocalModel, run_audit
from kvevict.audit.text import lines, task_line
from kvevict.audit.vllm_launch import VllmSettings, python, vllm_server
from kvevict.capacity import shape_of
from kvevict.errors import KvevictError
from kvevict.loading import load_tokenizer
from kvevict.loading.gguf import cache_root

import netns

pytestmark = [
    pytest.mark.vllm_server,
    pytest.mark.skipif(not python().exists(), reason=f"no vLLM at {python()}: run make vllm"),
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
]

NEW = 160  # tokens each stream generates: ten bootstrap blocks, judged whole (vLLM declares no eviction)
TIMEOUT = 1800.0  # seconds a request may take on two shared cores
#: Gemma 3's sliding window made longer than any stream here (every layer full attention): kvevict's sliding layers
#: hold window - 1 entries, so not a window of a million
WIDE = 2048


def converted(label: str):
    """kvevict's float32 safetensors folder of an embedded model (converted on its first load)."""
    from kvevict.loading import load_model

    found = sorted((cache_root() / "models").glob(f"{label}-*"))
    if not found:
        load_model(label)
        found = sorted((cache_root() / "models").glob(f"{label}-*"))
    return found[-1]


def logged_capacity(log) -> tuple[int, float]:
    """(KV tokens, concurrency) of vLLM's start-up line "CPU KV cache size: N tokens, Maximum concurrency ...: Xx"."""
    found = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: "
                      r"([\d.]+)x", log.read_text(errors="replace"))
    assert found, "vLLM logged no KV cache size"
    return int(found.group(1).replace(",", "")), float(found.group(2))


def metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        return answer.read().decode()


def served(url: str, name: str) -> float:
    """Requests vLLM finished, by its own counter (`vllm:request_success_total`, summed over finish reasons)."""
    pattern = rf'^vllm:request_success_total{{[^}}]*model_name="{name}"[^}}]*}} ([\d.e+]+)$'
    return sum(float(x) for x in re.findall(pattern, metrics(url), flags=re.M))


@pytest.fixture(scope="module")
def local():
    return LocalModel("smollm2-135m")


def _audit(url: str, out, reference: str | None = None, local=None, floor: str | None = None, **fields):
    endpoint = lambda u: Endpoint(u, timeout=TIMEOUT, retries=0)  # noqa: E731 (a retry would resend a long stream)
    spec = AuditSpec(deployment=endpoint(url), reference=endpoint(reference) if reference else None,
                     floor=endpoint(floor) if floor else None, route=fields.pop("route", "completions"),
                     served_model=fields.pop("served_model", "smollm2"), new_tokens=fields.pop("new_tokens", NEW),
                     out=out, **fields)
    return run_audit(spec, local)


class TestFloat32AndFp8:
    @pytest.fixture(scope="class")
    def servers(self, tmp_path_factory):
        model, logs = converted("smollm2-135m"), tmp_path_factory.mktemp("vllm-logs")
        with vllm_server(VllmSettings(model, cores="0"), logs / "float32.log", isolate=netns.command) as f32, \
                vllm_server(VllmSettings(model, kv_cache_dtype="fp8", cores="1"), logs / "fp8.log",
                            isolate=netns.command) as fp8:
            yield {"float32": f32, "fp8": fp8, "logs": logs}

    @pytest.fixture(scope="class")
    def audits(self, servers, local, tmp_path_factory):
        out = tmp_path_factory.mktemp("vllm-audits")
        found = {"float32": _audit(servers["float32"], out / "float32", local=local), "out": out}
        # fp8 against a second vLLM (float32 KV) scoring the stream in one request, then against kvevict's own
        # float32 cache with the float32 server as the twin: the deployment's stream is generated once
        before = served(servers["float32"], "smollm2")
        found["fp8-vllm"] = _audit(servers["fp8"], out / "fp8", reference=servers["float32"],
                                   reference_mode="prompt-logprobs")
        found["reference requests"] = served(servers["float32"], "smollm2") - before
        found["fp8"] = _audit(servers["fp8"], out / "fp8", local=local, floor=servers["float32"])
        return found

    def test_float32_kv_read_by_token_id_is_inside(self, audits):
        """No eviction declared, so the whole stream is judged; float32 KV on the same float32 weights as kvevict's
        cache: every greedy token kvevict's own top-1, the KL at the floor of float32 summation order."""
        found = audits["float32"]
        assert found.server.identity.kind == "vllm" and found.server.n_ctx == 1024  # max_model_len, /v1/models
        stream = found.deployed
        assert len(stream.tokens) == NEW and all(isinstance(t, int) for t in stream.tokens)
        assert stream.verdict.events == () and stream.verdict.outcome == "inside"
        assert stream.series["disagree"].max() == 0
        assert stream.series["kl"].mean() < 1e-6

    def test_the_tokenizer_is_checked_through_vllms_tokenize(self, servers):
        client = Client(Endpoint(servers["float32"]))
        assert check_tokenizer(client, load_tokenizer("smollm2-135m"), "smollm2")
        with pytest.raises(KvevictError, match="tokenizer disagrees"):
            check_tokenizer(client, load_tokenizer("gemma3-270m"), "smollm2")

    def test_a_second_vllm_scores_the_stream_in_one_request(self, servers, audits, local):
        """`--reference-mode prompt-logprobs`: one completion on the reference server (its own counter), whose top-20
        at every position is kvevict's float32 cache's: the same ids, log-probabilities within float32 noise."""
        assert audits["reference requests"] == 1
        by_server, by_kvevict = audits["fp8-vllm"].deployed, audits["fp8"].deployed
        assert by_server.tokens == by_kvevict.tokens  # the deployment's stream was generated once
        steps, prompt = by_server.generation.steps, by_server.plan.prompt
        theirs = prompt_logprobs_reference(Client(Endpoint(servers["float32"], timeout=TIMEOUT)), "smollm2", prompt,
                                           steps, 20)
        ours = local_reference(local.get(), prompt, steps, 20)
        assert [t.ids for t in theirs] == [t.ids for t in ours]
        gap = max(abs(a - b) for t, o in zip(theirs, ours, strict=True) for a, b in zip(t.logprobs, o.logprobs))
        assert gap < 5e-4
        assert by_server.verdict.outcome == by_kvevict.verdict.outcome == "inside"

    def test_fp8_kv_is_judged_against_its_twin_and_reproduced_inside_by_vllms_rule(self, audits, local):
        """fp8 KV costs a measurable KL against float32 KV over the whole stream, inside the tolerance, far above the
        twin's floor (the same vLLM with float32 KV); kvevict's `vllmfp8+full` (scale 1.0, codes cut toward zero) on
        the deployment's own tokens agrees with it (`Reproduction.agrees`); the calibrated, rounding `fp8+full`
        loses less than the audit sees from outside, which a lower bound cannot, and does not agree."""
        found = audits["fp8"]
        stream, twin = found.deployed, found.floor
        assert stream.verdict.events == () and stream.verdict.outcome == "inside"
        assert stream.series["kl"].mean() > 1000 * max(twin.series["kl"].mean(), 1e-12)
        vllm = reproduce(local.get(), stream, "vllmfp8+full")
        calibrated = reproduce(local.get(), stream, "fp8+full")
        assert vllm.agrees(), vllm.as_dict()
        assert not calibrated.agrees() and calibrated.kl_kvevict < vllm.kl_audit, calibrated.as_dict()

    def test_what_fp8_buys_is_what_kvevicts_arithmetic_says(self, servers, audits):
        """vLLM's declared KV tokens (`/metrics`, and its start-up log) in 1 GiB: kvevict's paged count at the
        dtype's bytes, 23,296 and 93,184 on SmolLM2; the audit's line sets the gain beside the cost."""
        from kvevict.loading import load_config

        shape = shape_of(load_config("smollm2-135m"), 4)
        for name, tokens in (("float32", 23_296), ("fp8", 93_184)):
            found = declared(metrics(servers[name]))
            assert found is not None and found.memory == 2**30
            assert found.tokens == tokens == logged_capacity(servers["logs"] / f"{name}.log")[0]
            assert capacity(found, shape, "float32").agrees
        buys = audits["fp8"].buys
        assert buys is not None and buys.source == servers["float32"]  # the twin declares the float32 cache
        assert (buys.deployment.declared.tokens, buys.baseline.declared.tokens) == (93_184, 23_296)
        alone = audits["fp8-vllm"].buys  # beside the reference server, which declares it too
        assert alone.source == servers["float32"] and alone.baseline.declared.tokens == 23_296
        line = next(x for x in lines(audits["fp8"]) if "the sequences of" in x)
        assert line.startswith("fp8 KV: KL ") and "inside; 4.00x the sequences of float32 KV" in line

    def test_the_chat_route_carries_the_tasks_workload(self, servers, tmp_path):
        """The conversation's probes as chat messages, vLLM's own chat template on both sides, judged paired."""
        found = _audit(servers["fp8"], tmp_path, reference=servers["float32"], route="chat", conversations=1,
                       conversation_turns=4)
        assert found.deployed is None and found.tasks
        for row in found.tasks:
            assert row.scores and len(row.scores) == len(row.reference) and row.judgement is not None

    def test_a_prompt_beyond_max_model_len_is_reported_as_refused(self, servers, audits):
        """Both servers refuse a 1,100-token prompt at max_model_len 1,024 (HTTP 400, "maximum context length"):
        the row says so in one line, nothing scored. (The fidelity stream comes from the records.)"""
        found = _audit(servers["fp8"], audits["out"] / "fp8", reference=servers["float32"],
                       reference_mode="prompt-logprobs", generation_trials=1, task_length=1100)
        assert found.deployed.tokens == audits["fp8"].deployed.tokens  # from the records
        (row,) = found.tasks
        assert row.refused == [0] and not row.scores
        line = task_line(row)
        assert "refused every prompt" in line and "\n" not in line


def kl_against(model, stream) -> float:
    """The stream's mean top-k KL against `model`'s full cache (as the audit's local reference computes it)."""
    ref = local_reference(model, stream.plan.prompt, stream.generation.steps, stream.plan.k)
    return float(columns([point(r, s, stream.plan.ended) for r, s in zip(ref, stream.generation.steps,
                                                                          strict=True)])["kl"].mean())


class TestE5m2AndGemma3:
    @pytest.fixture(scope="class")
    def servers(self, tmp_path_factory):
        logs = tmp_path_factory.mktemp("vllm-logs")
        e5m2 = VllmSettings(converted("smollm2-135m"), kv_cache_dtype="fp8_e5m2", cores="0")
        gemma = VllmSettings(converted("gemma3-270m"), served="gemma3", cores="1")
        with vllm_server(e5m2, logs / "e5m2.log", isolate=netns.command) as a, \
                vllm_server(gemma, logs / "gemma3.log", isolate=netns.command) as b:
            yield {"e5m2": a, "gemma3": b}

    def test_e5m2_is_reproduced_by_its_own_format_alone(self, servers, local, tmp_path):
        """`--kv-cache-dtype fp8_e5m2`: 2 mantissa bits, a larger loss than e4m3's; vLLM's rule in that format
        agrees with it, in e4m3 it does not; the capacity is fp8's."""
        found = _audit(servers["e5m2"], tmp_path, local=local)
        stream = found.deployed
        e5m2 = reproduce(local.get(), stream, "vllmfp8:format=e5m2+full")
        e4m3 = reproduce(local.get(), stream, "vllmfp8+full")
        assert e5m2.agrees(), e5m2.as_dict()
        assert not e4m3.agrees() and e4m3.kl_kvevict < e5m2.kl_kvevict, e4m3.as_dict()
        assert found.buys.deployment.declared.tokens == found.buys.deployment.arithmetic == 93_184

    def test_gemma3_sliding_layers_are_served_as_the_model_defines_them(self, servers, tmp_path):
        """Gemma 3 270M (a 512-token window on 15 of its 18 layers) on vLLM, a 700-token prompt and 96 generated
        tokens, so every generated token sees up to 285 tokens its sliding layers must not: against kvevict's full
        cache, which keeps each sliding layer's own window, every top-1 is the same and the KL at float32's floor;
        against the same model with every layer attending to all of it, the KL is orders of magnitude above."""
        gemma = LocalModel("gemma3-270m")
        found = _audit(servers["gemma3"], tmp_path, local=gemma, served_model="gemma3", model="gemma3-270m",
                       prompt_tokens=700, new_tokens=96)
        stream = found.deployed
        assert stream.verdict.outcome == "inside" and stream.series["disagree"].max() == 0
        windowed = float(stream.series["kl"].mean())
        assert windowed < 1e-6
        model = gemma.get()
        text = model.config.get_text_config(decoder=True)
        text.sliding_window = WIDE  # a window longer than the stream: every layer full attention
        for layer in model.model.layers:
            layer.self_attn.sliding_window = WIDE
        assert kl_against(model, stream) > 1000 * max(windowed, 1e-9)
