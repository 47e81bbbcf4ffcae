"""`--reproduce SPEC` (`audit/reproduction.py`): the deployment's own tokens through any kvevict spec.

A synthetic stream (no server): the tokens a deployment might have generated, judged with no eviction event
(a server that never evicts, as vLLM) or with llama-server's. Bare `llamacpp` takes the deployment's keep and
BOS; any other spec runs as written; a spec that cannot run is refused in one line before any request.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvevict.audit.api import Generation, Step
from kvevict.audit.fidelity import Point
from kvevict.audit.judge import judge_stream
from kvevict.audit.reproduction import reproduce, spec_for
from kvevict.audit.stream import StreamPlan, StreamResult
from kvevict.errors import KvevictError
from kvevict.stats.tolerance import Tolerance

from conftest import make_tiny
from support import cli_error


def stream(n_ctx: int, n_keep: int = 0, seed: int = 0, count: int = 60) -> StreamResult:
    """`count` generated tokens after a 10-token prompt, a deployment agreeing with its reference everywhere."""
    rng = np.random.default_rng(seed)
    plan = StreamPlan(tuple(int(x) for x in rng.integers(3, 100, 10)), count, 4, n_ctx, n_keep=n_keep)
    generation = Generation("", tuple(Step(int(t), -1.0, (int(t),), (-1.0,)) for t in rng.integers(3, 100, count)),
                            None, 10)
    series = {"kl": np.zeros(count), "disagree": np.zeros(count), "ref_nll": np.ones(count),
              "best_nll": np.ones(count)}
    verdict = judge_stream(series, plan.events(), Tolerance())
    return StreamResult("as deployed", plan, generation, [Point(True, 1.0, 1.0, 0.0, 0.0)] * count, verdict, series)


def test_a_quantized_spec_on_a_stream_without_events_reads_the_whole_stream():
    """vLLM's fp8 rule on a stream no eviction touches: no shift on either side, the reproduction's KL over every
    generated token positive (the codes moved the distribution) and the audit's (zero here) beside it."""
    found = reproduce(make_tiny(seed=5), stream(n_ctx=512), "vllmfp8+full", chunk=4)
    assert found.spec == "vllmfp8+full"
    assert found.shifts_audit == () == found.shifts_kvevict
    assert found.kl_kvevict > 0 and found.kl_audit == 0 and found.floor_disagree == 0
    assert "reproduced inside by vllmfp8+full" in found.line()


def test_bare_llamacpp_takes_the_deployments_keep():
    result = stream(n_ctx=32, n_keep=2)
    assert spec_for("llamacpp", result) == "llamacpp:keep=2,bos=0"
    assert spec_for("fp8+full", result) == "fp8+full"


def test_a_spec_that_cannot_run_is_refused_before_any_request():
    """The URL answers nothing (port 9 on loopback): the refusal is the spec's, so it came first."""
    cli_error("audit", "http://127.0.0.1:9", "--reproduce", "lru+full", needles=("unknown policy 'lru+full'",))
    with pytest.raises(KvevictError, match="format=e4m3"):
        reproduce(make_tiny(seed=5), stream(n_ctx=512), "vllmfp8:format=e3m4+full")


def test_a_rule_that_loses_less_than_the_deployment_is_told_apart():
    """The audit's top-k KL bounds the full KL from below, so a reproduction whose full KL lies well under the
    audit's is not the deployment's rule: vLLM's fp8 KV read 0.0020 nats a token from outside on SmolLM2, its own
    rule 0.0026 inside, kvevict's calibrated e4m3 0.0008. Where the stream has an A/A floor, the floor's KL is
    the arithmetic the two sides may differ by beyond that."""
    from kvevict.audit.reproduction import Reproduction

    def seen(kl_kvevict: float, floor_kl: float = 0.0) -> Reproduction:
        return Reproduction("spec", (), (), 0.0, 0.0, 0.0020, kl_kvevict, 0.0, floor_kl)

    assert seen(0.0026).agrees()
    assert not seen(0.0008).agrees()
    assert seen(0.0008, floor_kl=0.002).agrees()
    assert not seen(0.0070).agrees()  # below a third of it: the coarse-graining cannot lose that much
