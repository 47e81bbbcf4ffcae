"""Two caches on two models in two threads at once give what each gives alone.

kvevict's attention function finds its cache layer in the arguments the model hands
it, not in shared state, so interleaved forwards cannot cross.
"""

from __future__ import annotations

import threading

import torch

from kvevict import compare

from conftest import make_tiny, random_tokens


def test_two_caches_in_two_threads_equal_running_alone():
    jobs = [
        (make_tiny(seed=21), random_tokens(160, seed=22), ["h2o", "sink2+snapkv:window=4"], "original"),
        (make_tiny(seed=23), random_tokens(150, seed=24), ["window", "sinkauto2+h2o"], "cache"),
    ]

    def run(job):
        model, tokens, specs, positions = job
        rows, _ = compare(model, tokens, specs, budget=20, positions=positions, reference=False, progress=False)
        return [(r.nll, r.sink_lost_at) for r in rows]

    alone = [run(job) for job in jobs]
    for _ in range(3):  # interleaving varies from run to run: give a crossing several chances to show
        together = run_together(run, jobs)
        for a, b in zip(alone, together):
            assert b is not None, "a thread failed"
            for (nll_a, lost_a), (nll_b, lost_b) in zip(a, b):
                assert torch.equal(nll_a, nll_b)
                assert lost_a == lost_b


def run_together(run, jobs: list) -> list:
    """`run(job)` for every job, each in its own thread, all started at once."""
    results: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def worker(i: int) -> None:
        start.wait()
        results[i] = run(jobs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
