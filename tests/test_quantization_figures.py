"""docs/quantization.md says what its records say: every figure that has a record is read out of the doc (its tables
cell by cell, its prose by the sentence) and recomputed from the raw records (`doc_records.py`: JSON lines, the paired
block bootstrap and Wilson's interval written out with scipy, not the report code that printed them). Editing either
side alone fails here. No model runs.
"""

from __future__ import annotations

import math
import re

import pytest

from doc_records import (
    INTERVAL,
    RESULTS,
    changed,
    check,
    check_interval,
    doc,
    full,
    headed_table,
    lines,
    matches,
    mib,
    number,
    paired,
    row,
    said,
    table,
    wilson,
)

PATH = "docs/quantization.md"
DEPLOYED = "q4:group=64,residual=128+"
KIVI = "q4:group=64,residual=128,keys=channel+"


def text() -> str:
    return doc(PATH)


def ppl_of(name: str, label: str, budget=None) -> dict:
    return full(name) if label == "full" else row(name, label, *(() if budget is None else (budget,)))


def bytes_of(name: str, label: str) -> float:
    """KV MiB per sequence at bf16 a row held at the end of its stream; the full cache's as its rows counted it."""
    if label == "full":
        return next(r for r in lines(name) if "full_kv_bytes_bf16" in r)["full_kv_bytes_bf16"] / 2**20
    return mib(row(name, label))


def ratio(a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float, float]:
    """PPL of `(file, label)` a over b, paired."""
    return paired((a[0], ppl_of(*a)), (b[0], ppl_of(*b)))


# --- the step tables: a row is "before → after", each column recomputed -----------------------------------------

#: a step table's row label -> (after, before), labels as the records spell them
STEPS = {
    "**sink gap**: `sink4+window` → `window`, budget 1024": ("window", "sink4+window"),
    "full cache 16 → 8 bits": ("q8+full", "full"),
    "full cache 8 → 4 bits": ("q4+full", "q8+full"),
    "full cache 4 → 2 bits": ("q2+full", "q4+full"),
    "`sink4+window` 16 → 8 bits": ("q8+sink4+window", "sink4+window"),
    "`sink4+window` 8 → 4 bits": ("q4+sink4+window", "q8+sink4+window"),
    "`sink4+window` 4 → 2 bits": ("q2+sink4+window", "q4+sink4+window"),
    "full cache 16 bits → `fp8`": ("fp8+full", "full"),
    "`sink4+window` 16 bits → `fp8`": ("fp8+sink4+window", "sink4+window"),
    "`sink4+window` `fp8` → 4 bits": ("q4+sink4+window", "fp8+sink4+window"),
    "full cache 8 bits → 4 bits as deployed (`q4:group=64,residual=128`)": (DEPLOYED + "full", "q8+full"),
    "`sink4+window` 8 bits → 4 bits as deployed": (DEPLOYED + "sink4+window", "q8+sink4+window"),
    "`sink4+window` 4 bits, no residual → as deployed": (DEPLOYED + "sink4+window", "q4+sink4+window"),
    "full cache 8 bits → 4 bits, KIVI's keys as deployed (`q4:group=64,residual=128,keys=channel`)":
        (KIVI + "full", "q8+full"),
    "`sink4+window` 8 bits → 4 bits, KIVI's keys as deployed": (KIVI + "sink4+window", "q8+sink4+window"),
}

#: each step table: the line it follows, the record file of its bounded rows and of its full-cache rows
STEP_TABLES = {
    "SmolLM2 at 4K": ("### The seed's claim", "quant-claim-4k.jsonl", "quant-claim-4k.jsonl"),
    "Gemma 3 at 4K": ("`docs/results/quant-claim-4k-gemma3.jsonl`:", "quant-claim-4k-gemma3.jsonl",
                      "quant-claim-4k-gemma3.jsonl"),
    "SmolLM2 at 20K": ("Records: `docs/results/quant-claim-20k-cache.jsonl`", "quant-claim-20k-cache.jsonl",
                       "quant-claim-20k.jsonl"),
    "Gemma 3 at 20K": ("Records: `docs/results/quant-claim-20k-gemma3.jsonl`", "quant-claim-20k-gemma3.jsonl",
                       "quant-claim-20k-gemma3.jsonl"),
}


def step_file(name: str, after: str, before: str) -> str:
    """The file of a step: a step between full caches is in the full caches' file."""
    _, bounded, unbounded = STEP_TABLES[name]
    return unbounded if after.endswith("full") else bounded


def arrow(cell: str) -> tuple[str, str]:
    before, after = cell.split("→")
    return before.strip(), after.strip()


@pytest.mark.parametrize("name", STEP_TABLES)
def test_every_step_table_row_is_its_records(name):
    anchor = STEP_TABLES[name][0]
    rows = table(PATH, anchor)
    assert len(rows) >= 7, f"{name}: the table after '{anchor}' has {len(rows)} rows"
    for label, ppls, ratio_cell, bytes_cell in rows:
        assert label in STEPS, f"{name}: a row this test does not know: {label}"
        after, before = STEPS[label]
        file = step_file(name, after, before)
        ppl_before, ppl_after = arrow(ppls)
        check(ppl_before, ppl_of(file, before)["ppl"], f"{name}: {before}'s PPL")
        check(ppl_after, ppl_of(file, after)["ppl"], f"{name}: {after}'s PPL")
        written = re.fullmatch(INTERVAL, ratio_cell.strip("*"))
        assert written, ratio_cell
        check_interval(written.groups(), ratio((file, after), (file, before)), f"{name}: {label}")
        mib_before, mib_after = arrow(bytes_cell)
        check(mib_before, bytes_of(file, before), f"{name}: {before}'s bytes")
        check(mib_after, bytes_of(file, after), f"{name}: {after}'s bytes")


def steps_between(name: str, labels: list[tuple[str, str]]) -> list[float]:
    """PPL ratios after / before of `labels`' steps in step table `name`'s records."""
    return [ratio((step_file(name, a, b), a), (step_file(name, a, b), b))[0] for a, b in labels]


EIGHT_TO_FOUR = [("q4+full", "q8+full"), ("q4+sink4+window", "q8+sink4+window")]
FOUR_TO_TWO = [("q2+full", "q4+full"), ("q2+sink4+window", "q4+sink4+window")]
AS_DEPLOYED = [(DEPLOYED + "full", "q8+full"), (DEPLOYED + "sink4+window", "q8+sink4+window")]


def sink_gap(name: str) -> float:
    return steps_between(name, [("window", "sink4+window")])[0]


# --- "What you decide from it" ---------------------------------------------------------------------------------


def test_what_each_step_of_bits_costs():
    q8, q8_low, q8_high, fp8, fp8_low, fp8_high, fp8s, fp8s_low, fp8s_high = said(text(), (
        r"16 → 8 nothing measurable with integer codes \(`q8`: " + INTERVAL + r" on SmolLM2's full cache at 4K\), "
        r"1\.02× with `fp8` \(e4m3: " + INTERVAL + r" on the full cache, " + INTERVAL + r" on `sink4\+window`\)"))
    name = "quant-claim-4k.jsonl"
    found = ratio((name, "q8+full"), (name, "full"))
    check_interval((q8, q8_low, q8_high), found, "q8+full against the full cache")
    assert found[1] <= 1 <= found[2], "nothing measurable: the interval holds 1"
    check_interval((fp8, fp8_low, fp8_high), ratio((name, "fp8+full"), (name, "full")), "fp8+full")
    check_interval((fp8s, fp8s_low, fp8s_high), ratio((name, "fp8+sink4+window"), (name, "sink4+window")),
                   "fp8+sink4+window")
    (smollm2_low, smollm2_high, gemma_low, gemma_high, deployed_low, deployed_high, two_low, two_high, g2_low,
     g2_high) = said(
        text(), r"8 → 4 (\d\.\d\d)–(\d\.\d\d)× on SmolLM2, (\d\.\d\d)–(\d\.\d\d)× on Gemma 3 \(group 32, no "
            r"residual\), "
        r"(\d\.\d+)–(\d\.\d+)× on SmolLM2 at 4K as deployed .*? 4 → 2 collapses the model \((\d\.\d)–(\d\.\d)× and "
        r"(\d+)–(\d+)×\)")
    smollm2 = steps_between("SmolLM2 at 4K", EIGHT_TO_FOUR) + steps_between("SmolLM2 at 20K", EIGHT_TO_FOUR)
    gemma = steps_between("Gemma 3 at 4K", EIGHT_TO_FOUR) + steps_between("Gemma 3 at 20K", EIGHT_TO_FOUR)
    deployed = steps_between("SmolLM2 at 4K", AS_DEPLOYED)
    for (low, high), values, what in (((smollm2_low, smollm2_high), smollm2, "SmolLM2's 8 → 4 steps"),
                                      ((gemma_low, gemma_high), gemma, "Gemma 3's 8 → 4 steps"),
                                      ((deployed_low, deployed_high), deployed, "the deployed 8 → 4 steps"),
                                      ((two_low, two_high), steps_between("SmolLM2 at 4K", FOUR_TO_TWO)
                                       + steps_between("SmolLM2 at 20K", FOUR_TO_TWO), "SmolLM2's 4 → 2 steps"),
                                      ((g2_low, g2_high), steps_between("Gemma 3 at 4K", FOUR_TO_TWO)
                                       + steps_between("Gemma 3 at 20K", FOUR_TO_TWO), "Gemma 3's 4 → 2 steps")):
        check(low, min(values), what + ", the least")
        check(high, max(values), what + ", the most")


def test_what_four_bits_cost_as_deployments_run_them():
    low, high, reach, within, without_low, without_high, fp8, fp8_low, fp8_high, times = said(text(), (
        r"With the latest 128 tokens at full precision, (\d\.\d)–(\d\.\d)% on SmolLM2 \(group 32 and 64; intervals "
        r"reach (\d\.\d)%\), within (\d\.\d\d)% of transformers' `QuantizedCache` \(quanto\) at the same settings; "
        r"without that residual (\d\.\d)–(\d+)%\. `fp8` (\d\.\d)% \(interval from (−?\d\.\d)% to (\d\.\d)%\) at "
        r"(\d\.\d)× their bytes"))
    name = "quant-gap-1k.jsonl"
    kept = [ratio((name, spec), (name, "full")) for spec in ("q4:residual=128+full", DEPLOYED + "full")]
    check(low, 100 * (min(r[0] for r in kept) - 1), "the smaller loss with a residual")
    check(high, 100 * (max(r[0] for r in kept) - 1), "the larger loss with a residual")
    check(reach, 100 * (max(r[2] for r in kept) - 1), "the top of their intervals")
    gap = quant_gap_txt()
    ours, theirs = gap["kvevict q4:group=64,residual=128+full"][0], gap["QuantizedCache quanto"][0]
    assert 100 * (ours / theirs - 1) <= number(within)
    lost = [ratio((name, spec), (name, "full"))[0] for spec in ("q4+full", "q4:group=64+full")]
    check(without_low, 100 * (min(lost) - 1), "the smaller loss without a residual")
    check(without_high, 100 * (max(lost) - 1), "the larger loss without a residual")
    found = ratio((name, "fp8+full"), (name, "full"))
    check(fp8, 100 * (found[0] - 1), "fp8 over 1,000 tokens")
    check(fp8_low, 100 * (found[1] - 1), "the bottom of fp8's interval")
    check(fp8_high, 100 * (found[2] - 1), "the top of fp8's interval")
    check(times, bytes_of(name, "fp8+full") / bytes_of(name, DEPLOYED + "full"), "fp8's bytes over deployed 4 bits'")


def test_is_losing_the_sink_worse_than_a_step_of_bits():
    small4k, small20k, gemma4k, gemma20k, under = said(text(), (
        r"Worse than 8 → 4, milder than 4 → 2: (\d\.\d\d)× at 4K and (\d\.\d\d)× at 20K on SmolLM2, (\d\.\d\d)× and "
        r"(\d\.\d\d)× on Gemma 3; against 8 → 4 bits as deployed \(under (\d)% at 4K\)"))
    for written, name in ((small4k, "SmolLM2 at 4K"), (small20k, "SmolLM2 at 20K"), (gemma4k, "Gemma 3 at 4K"),
                          (gemma20k, "Gemma 3 at 20K")):
        check(written, sink_gap(name), f"the sink gap, {name}")
    assert 100 * (max(steps_between("SmolLM2 at 4K", AS_DEPLOYED)) - 1) < number(under)


def test_at_equal_memory_on_perplexity_and_on_retrieval():
    above, reach, deployed, behind, behind_q4 = said(text(), (
        r"`q8\+h2o` at 910 entries is (\d\.\d)% above the full cache \(its interval reaches (\d\.\d)%\) and "
        r"`q4:group=64,residual=128\+h2o` at 1,365 (\d\.\d)%, not told apart; 16-bit `h2o` at 512 is (\d\.\d)% behind "
        r"`q8\+h2o`, `q4\+h2o` at 1,638 without the residual (\d\.\d)%"))
    name = "quant-bytes-4k.jsonl"
    q8 = (name, row(name, "q8+h2o", 910))
    found = paired(q8, (name, full(name)))
    check(above, 100 * (found[0] - 1), "q8+h2o at 910")
    check(reach, 100 * (found[2] - 1), "the top of its interval")
    four = (name, row(name, DEPLOYED + "h2o", 1365))
    check(deployed, 100 * (paired(four, (name, full(name)))[0] - 1), "the deployed q4+h2o at 1,365")
    tie = paired(four, q8)
    assert tie[1] <= 1 <= tie[2], "not told apart"
    check(behind, 100 * (paired((name, row(name, "h2o", 512)), q8)[0] - 1), "h2o at 512 behind q8+h2o")
    check(behind_q4, 100 * (paired((name, row(name, "q4+h2o", 1638)), q8)[0] - 1), "q4+h2o at 1,638 behind it")
    counts = said(text(), r"`q4\+tova` answers (\d+)/(\d+) single needles at an eighth of the cache against "
        r"(\d+)/(\d+) "
                          r"at 16 bits, (\d+)/(\d+) at a quarter against (\d+)/(\d+)")
    cells = [("q4+tova", "819"), ("tova", "256"), ("q4+tova", "1638"), ("tova", "512")]
    for (policy, budget), hits, n in zip(cells, counts[::2], counts[1::2], strict=True):
        assert needle(policy, budget) == (int(hits), int(n)), (policy, budget)


def needle(policy: str, budget: str) -> tuple[int, int]:
    cell = [r["score"] for r in lines("quant-niah-2k.jsonl") if r["policy"] == policy and r["budget"] == budget]
    return int(sum(cell)), len(cell)


# --- 4 bits against QuantizedCache, and with and without a residual, over 1,000 tokens -------------------------


def quant_gap_txt() -> dict[str, tuple[float, float]]:
    """quant-gap-smollm2-1000.txt: cache -> (PPL, its ratio to the full cache), as the tool printed them."""
    out = {}
    for line in (RESULTS / "quant-gap-smollm2-1000.txt").read_text().splitlines():
        found = re.match(r"(.+?)\s+PPL\s+([\d.]+)\s+x([\d.]+) of full", line)
        out[found.group(1)] = (float(found.group(2)), float(found.group(3)))
    return out


#: the doc's rows of the QuantizedCache comparison -> the tool's names for them
GAP_ROWS = {
    "kvevict `q4:group=64,residual=128+full`": "kvevict q4:group=64,residual=128+full",
    "transformers' `QuantizedCache` (quanto, 4 bits, same group and residual)": "QuantizedCache quanto",
    "kvevict `q4:group=64,residual=128,keys=channel+full` (per-channel keys)":
        "kvevict q4:group=64,residual=128,keys=channel+full",
    "kvevict's, under quanto's quantizer (emulated)": "emulated quanto keys=token ring",
    "kvevict's, under QuantizedCache's flush schedule (emulated)": "emulated hqq keys=token flush",
    "kvevict's, keys per channel on the ring (emulated)": "emulated hqq keys=channel ring",
}


def test_four_bits_against_quantized_cache():
    rows = table(PATH, "(quanto) is measured token by token")
    gap = quant_gap_txt()
    (reference,) = said(text(), r"\| cache, fed token by token from an empty cache \| PPL \| against the full cache "
                                r"\((\d+\.\d+)\) \|")
    check(reference, gap["full"][0], "the full cache over 1,000 tokens")
    assert sorted(label for label, _, _ in rows) == sorted(GAP_ROWS)
    for label, ppl_cell, ratio_cell in rows:
        check(ppl_cell, gap[GAP_ROWS[label]][0], label)
        check(ratio_cell.rstrip("×"), gap[GAP_ROWS[label]][1], label)
    (within,) = said(text(), r"Fed this way, kvevict's 4-bit storage is within (\d\.\d\d)% of `QuantizedCache`'s")
    ours, theirs = gap["kvevict q4:group=64,residual=128+full"][0], gap["QuantizedCache quanto"][0]
    assert 100 * abs(ours / theirs - 1) <= number(within)
    per_channel = math.log(gap["kvevict q4:group=64,residual=128,keys=channel+full"][1])
    assert round(3 * per_channel / math.log(gap["kvevict q4:group=64,residual=128+full"][1])) == 1, "a third as much"


#: the rows of the 1,000-token sweep -> the spec its records hold
SWEEP_1K = {
    "`q8` (group 32)": "q8+full", "`fp8` (one scale per layer)": "fp8+full", "`fp8:scale=head`": "fp8:scale=head+full",
    "`q4:residual=128` (group 32)": "q4:residual=128+full",
    "`q4:group=64,residual=128` (`QuantizedCache`'s setting)": DEPLOYED + "full",
    "`q4` (group 32, no residual)": "q4+full", "`q4:group=64` (no residual)": "q4:group=64+full",
}


def test_what_four_bits_cost_is_mostly_the_residual():
    name = "quant-gap-1k.jsonl"
    rows = table(PATH, "**What 4 bits cost is mostly the residual.**")
    (full_bytes,) = said(text(), r"\| KV MiB/seq bf16 \(full (\d+\.\d+)\) \|")
    check(full_bytes, bytes_of(name, "full"), "the full cache's bytes over 1,000 tokens")
    assert sorted(label for label, _, _ in rows) == sorted(SWEEP_1K)
    for label, ratio_cell, bytes_cell in rows:
        spec = SWEEP_1K[label]
        check_interval(re.fullmatch(INTERVAL, ratio_cell).groups(), ratio((name, spec), (name, "full")), label)
        check(bytes_cell, bytes_of(name, spec), f"{label}'s bytes")
    g32_from, g32_to, g64_from, g64_to, more, times = said(text(), (
        r"takes the loss from (\d\.\d)% to (\d\.\d)% at group 32 and from (\d+)% to (\d\.\d)% at group 64, for "
        r"(\d\.\d) "
        r"MiB more at this length .*? `fp8` with one scale per layer costs nothing measurable, at (\d\.\d) times the "
        r"bytes of `q4` with that residual"))
    loss = lambda spec: 100 * (ratio((name, spec), (name, "full"))[0] - 1)  # noqa: E731
    check(g32_from, loss("q4+full"), "group 32 without a residual")
    check(g32_to, loss("q4:residual=128+full"), "group 32 with one")
    check(g64_from, loss("q4:group=64+full"), "group 64 without a residual")
    check(g64_to, loss(DEPLOYED + "full"), "group 64 with one")
    for with_ring, without in (("q4:residual=128+full", "q4+full"), (DEPLOYED + "full", "q4:group=64+full")):
        check(more, bytes_of(name, with_ring) - bytes_of(name, without), f"the ring's bytes, {with_ring}")
    fp8 = ratio((name, "fp8+full"), (name, "full"))
    assert fp8[1] <= 1 <= fp8[2], "fp8 costs nothing measurable over 1,000 tokens"
    check(times, bytes_of(name, "fp8+full") / bytes_of(name, DEPLOYED + "full"), "fp8's bytes over q4's as deployed")
    alone = {line.split()[0]: float(line.split()[1]) for line in
             (RESULTS / "quant-gap-ppl-1000.txt").read_text().splitlines() if not line.startswith("#")}
    no_ring, no_ring_ratio, ring, ring_ratio = said(text(), (
        r"give (\d+\.\d+) at group 64 without a residual \((\d\.\d+)×\) and (\d+\.\d+) with one of 128 \((\d\.\d+)×\)"))
    for ppl_text, ratio_text, spec in ((no_ring, no_ring_ratio, "q4:group=64,keys=channel+full"),
                                       (ring, ring_ratio, "q4:group=64,residual=128,keys=channel+full")):
        check(ppl_text, alone[spec], spec)
        check(ratio_text, alone[spec] / alone["full"], spec + " over the full cache")


# --- the claim at 4K and 20K, both models: what the prose makes of the step tables ----------------------------


def logs(big: float, small: float) -> float:
    """How many steps of `small` make `big`, in log terms."""
    return math.log(big) / math.log(small)


def test_the_sink_gap_against_one_level_on_smollm2_at_4k():
    name, step = "quant-claim-4k.jsonl", "SmolLM2 at 4K"
    gap, low, high, steps_low, steps_high, two_low, two_high, fp8, fewer = said(text(), (
        r"Losing the sinks at budget 1,024 costs (\d\.\d\d)× perplexity; dropping the KV cache from 8 to 4 bits costs "
        r"(\d\.\d\d)-(\d\.\d\d)× .*? the sink gap is about (\d)-(\d) such steps\. From 4 to 2 bits .*? collapses: "
        r"(\d\.\d)-(\d\.\d)×, far beyond the sink gap\. `fp8` .*? costs (\d\.\d\d)× where 8-bit integer codes cost "
        r"nothing, at (\d+)% fewer bytes than `q8`'s"))
    check(gap, sink_gap(step), "the sink gap at 4K")
    four = [ratio((name, a), (name, b)) for a, b in EIGHT_TO_FOUR]
    check(low, min(r[0] for r in four), "the smaller 8 → 4 step")
    check(high, max(r[0] for r in four), "the larger 8 → 4 step")
    gap_low = ratio((name, "window"), (name, "sink4+window"))[1]
    assert max(r[2] for r in four) < gap_low, "both intervals below the gap's"
    for a, b in (("q8+full", "full"), ("q8+sink4+window", "sink4+window")):
        found = ratio((name, a), (name, b))
        assert found[1] <= 1 <= found[2], f"{a}: nothing measurable"
    check(steps_low, logs(sink_gap(step), max(r[0] for r in four)), "the gap in the larger step")
    check(steps_high, logs(sink_gap(step), min(r[0] for r in four)), "the gap in the smaller step")
    two = steps_between(step, FOUR_TO_TWO)
    check(two_low, min(two), "the smaller 4 → 2 step")
    check(two_high, max(two), "the larger 4 → 2 step")
    fp8_steps = [ratio((name, "fp8+" + r), (name, r))[0] for r in ("full", "sink4+window")]
    assert all(matches(fp8, s) for s in fp8_steps), fp8_steps
    check(fewer, 100 * (1 - bytes_of(name, "fp8+full") / bytes_of(name, "q8+full")), "fp8's bytes against q8's")
    assert round(3 * math.log(max(fp8_steps)) / math.log(min(r[0] for r in four))) == 1, "a third of the 8 → 4 step"
    total, alone, evicted = said(text(), r"\(`q4\+sink4\+window` (\d\.\d+) = (\d\.\d+) × (\d\.\d+) against the "
        r"full cache\)")
    check(total, ratio((name, "q4+sink4+window"), (name, "full"))[0], "q4+sink4+window over the full cache")
    check(alone, ratio((name, "sink4+window"), (name, "full"))[0], "sink4+window over the full cache")
    check(evicted, ratio((name, "q4+sink4+window"), (name, "q8+sink4+window"))[0], "its 8 → 4 step")


def test_four_bits_as_deployed_at_4k():
    name = "quant-claim-4k.jsonl"
    on_full, on_window, below, times, mine, theirs, ring, below_q8, least, most, fp8, fp8_low, fp8_high = said(text(), (
        r"costs (\d\.\d+)× on the full cache and (\d\.\d+)× on `sink4\+window` \(that interval includes 1\), against "
        r"1\.05-1\.06× for group 32 without the residual; its `sink4\+window` row is (\d\.\d)% below that one's, at "
        r"(\d\.\d) times its bytes \((\d\.\d+) MiB against (\d\.\d+), the ring's 128 full-precision tokens per layer "
        r"and head being (\d\.\d) MiB of it\) and still (\d+)% below `q8\+sink4\+window`'s\. Against that step "
        r"the sink "
        r"gap is about (\d+)-(\d+) steps in log terms: .*? \((\d\.\d)% above the deployed 4-bit row, \[(\d\.\d)%, "
        r"(\d\.\d)%\]\)"))
    deployed = [ratio((name, a), (name, b)) for a, b in AS_DEPLOYED]
    check(on_full, deployed[0][0], "the deployed step on the full cache")
    check(on_window, deployed[1][0], "the deployed step on sink4+window")
    assert deployed[1][1] <= 1 <= deployed[1][2]
    check(below, 100 * (1 - ratio((name, DEPLOYED + "sink4+window"), (name, "q4+sink4+window"))[0]),
          "the deployed row below the group-32 one")
    check(times, bytes_of(name, DEPLOYED + "sink4+window") / bytes_of(name, "q4+sink4+window"), "its bytes over theirs")
    check(mine, bytes_of(name, DEPLOYED + "sink4+window"), "the deployed row's bytes")
    check(theirs, bytes_of(name, "q4+sink4+window"), "the group-32 row's bytes")
    gap_1k = "quant-gap-1k.jsonl"  # the ring alone: group 64 with it and without it, the same model
    check(ring, bytes_of(gap_1k, DEPLOYED + "full") - bytes_of(gap_1k, "q4:group=64+full"), "the ring's bytes")
    check(below_q8, 100 * (1 - bytes_of(name, DEPLOYED + "sink4+window") / bytes_of(name, "q8+sink4+window")),
          "the deployed row's bytes below q8's")
    gap = sink_gap("SmolLM2 at 4K")
    check(least, logs(gap, max(r[0] for r in deployed)), "the gap in the larger deployed step")
    check(most, logs(gap, min(r[0] for r in deployed)), "the gap in the smaller deployed step")
    found = ratio((name, "fp8+sink4+window"), (name, DEPLOYED + "sink4+window"))
    check_interval((fp8, fp8_low, fp8_high), tuple(100 * (v - 1) for v in found), "fp8 above the deployed row")
    window, window_low, window_high, whole, whole_low, whole_high, more, kivi, per_token, gain = said(text(), (
        r"not told apart from the keys per token on `sink4\+window` "
        r"\(" + INTERVAL + r"\) and slightly ahead of them on "
        r"the full cache \(" + INTERVAL + r": the interval ends just below 1\), at (\d+)% more bytes on "
        r"`sink4\+window` \((\d+\.\d+) MiB against (\d\.\d+): .*? gains at most about (\d)% once"))
    on_window_ = ratio((name, KIVI + "sink4+window"), (name, DEPLOYED + "sink4+window"))
    check_interval((window, window_low, window_high), on_window_, "KIVI's keys on sink4+window")
    assert on_window_[1] <= 1 <= on_window_[2], "not told apart"
    on_full_ = ratio((name, KIVI + "full"), (name, DEPLOYED + "full"))
    check_interval((whole, whole_low, whole_high), on_full_, "KIVI's keys on the full cache")
    assert on_full_[2] < 1, "the whole interval below 1"
    check(more, 100 * (bytes_of(name, KIVI + "sink4+window") / bytes_of(name, DEPLOYED + "sink4+window") - 1),
          "KIVI's bytes over the keys per token")
    check(kivi, bytes_of(name, KIVI + "sink4+window"), "KIVI's bytes")
    check(per_token, bytes_of(name, DEPLOYED + "sink4+window"), "the keys per token's bytes")
    check(gain, 100 * (1 - on_full_[1]), "the most KIVI's keys gain")


def test_gemma3_at_4k():
    name, step = "quant-claim-4k-gemma3.jsonl", "Gemma 3 at 4K"
    gap, low, high, steps_low, steps_high, two_low, two_high = said(text(), (
        r"On Gemma the sink gap is \*\*comparable to one level, and larger\*\*: (\d\.\d\d) against "
        r"(\d\.\d\d)-(\d\.\d\d) "
        r"for 8 → 4 bits, the intervals apart \(about (\d\.\d)-(\d\.\d) steps in log terms\); 16 → 8 bits costs "
        r"nothing "
        r"and 4 → 2 bits collapses \((\d+)-(\d+)×\)"))
    four = [ratio((name, a), (name, b)) for a, b in EIGHT_TO_FOUR]
    check(gap, sink_gap(step), "Gemma 3's sink gap at 4K")
    check(low, min(r[0] for r in four), "the smaller 8 → 4 step")
    check(high, max(r[0] for r in four), "the larger 8 → 4 step")
    assert max(r[2] for r in four) < ratio((name, "window"), (name, "sink4+window"))[1], "the intervals apart"
    check(steps_low, logs(sink_gap(step), max(r[0] for r in four)), "the gap in the larger step")
    check(steps_high, logs(sink_gap(step), min(r[0] for r in four)), "the gap in the smaller step")
    for a, b in (("q8+full", "full"), ("q8+sink4+window", "sink4+window")):
        assert ratio((name, a), (name, b))[2] <= 1.0005, f"{a}: costs nothing"  # its interval ends at 1.000
    two = steps_between(step, FOUR_TO_TWO)
    check(two_low, min(two), "the smaller 4 → 2 step")
    check(two_high, max(two), "the larger 4 → 2 step")
    every, window, q8_share = said(text(), (
        r"\(The full row's (\d+) MiB in these records counts every layer at every token; .*? which makes it "
        r"(\d+\.\d) MiB at bf16, and `q8\+full` (\d+)% of it;"))
    check(every, bytes_of(name, "full"), "the full row's bytes as these records count them")
    counted = bytes_of("quant-bytes-4k-gemma3.jsonl", "full")  # the reports' count: sliding layers at their window
    check(window, counted, "the full cache's bytes with its sliding layers at their window")
    check(q8_share, 100 * bytes_of(name, "q8+full") / counted, "q8+full's share of it")
    low_mib, high_mib, behind, behind_low, behind_high = said(text(), (
        r"at (\d+\.\d+)-(\d+\.\d+) MiB, `q8\+full` \(the whole stream at 8 bits\) is lowest beyond the noise, "
        r"`sink4\+window` at 1024 ×" + INTERVAL + " behind it"))
    check(low_mib, bytes_of(name, "sink4+window"), "sink4+window's bytes")
    check(high_mib, bytes_of(name, "q8+full"), "q8+full's bytes")
    found = ratio((name, "sink4+window"), (name, "q8+full"))
    check_interval((behind, behind_low, behind_high), found, "sink4+window behind q8+full")
    assert found[1] > 1, "beyond the noise"


def test_smollm2_at_20k():
    step = "SmolLM2 at 20K"
    gap, earlier, low, high, steps, two_low, two_high, whole = said(text(), (
        r"Losing the sinks costs (\d\.\d\d)× \((\d\.\d\d)× at 4K\); one 8 → 4 bit step costs "
        r"(\d\.\d\d)-(\d\.\d\d)×, so "
        r"the sink gap is about (\d) such steps in log terms, and 16 → 8 bits costs nothing measurable\. 2 bits "
        r"collapses again \((\d\.\d)-(\d\.\d)×\), beyond the sink gap\. The full cache at 20K \((\d+\.\d)\)"))
    check(gap, sink_gap(step), "the sink gap at 20K")
    check(earlier, sink_gap("SmolLM2 at 4K"), "the sink gap at 4K")
    four = steps_between(step, EIGHT_TO_FOUR)
    check(low, min(four), "the smaller 8 → 4 step")
    check(high, max(four), "the larger 8 → 4 step")
    check(steps, logs(sink_gap(step), steps_between(step, [EIGHT_TO_FOUR[1]])[0]), "the gap in the step beside it")
    for a, b in (("q8+full", "full"), ("q8+sink4+window", "sink4+window")):
        file = step_file(step, a, b)
        found = ratio((file, a), (file, b))
        assert found[1] <= 1.0005 and found[2] >= 0.9995, f"{a}: nothing measurable"
    two = steps_between(step, FOUR_TO_TWO)
    check(two_low, min(two), "the smaller 4 → 2 step")
    check(two_high, max(two), "the larger 4 → 2 step")
    check(whole, full("quant-claim-20k.jsonl")["ppl"], "the full cache at 20K")
    name = "quant-claim-20k.jsonl"  # original positions
    window, sinks, turned, turned_low, turned_high, s8, s4, s4_low, s4_high, s2, s2_low, s2_high = said(text(), (
        r"`window` (\d+\.\d\d), `sink4\+window` (\d+\.\d\d) \(`window`/`sink4\+window` " + INTERVAL + r"\), and its "
        r"quantization steps are the same sizes \((\d\.\d+), " + INTERVAL + ", " + INTERVAL + r"\)"))
    check(window, row(name, "window")["ppl"], "window in original positions")
    check(sinks, row(name, "sink4+window")["ppl"], "sink4+window in original positions")
    check_interval((turned, turned_low, turned_high), ratio((name, "window"), (name, "sink4+window")), "window/sinks")
    check(s8, ratio((name, "q8+sink4+window"), (name, "sink4+window"))[0], "16 → 8 in original positions")
    check_interval((s4, s4_low, s4_high), ratio((name, "q4+sink4+window"), (name, "q8+sink4+window")), "8 → 4 there")
    check_interval((s2, s2_low, s2_high), ratio((name, "q2+sink4+window"), (name, "q4+sink4+window")), "4 → 2 there")


def test_gemma3_at_20k():
    step, name = "Gemma 3 at 20K", "quant-claim-20k-gemma3.jsonl"
    (gap, earlier, four_, gap_low, gap_high, four_low, four_high, steps_low, steps_high, two_window, two_full,
     share) = said(
        text(), (r"losing the sinks costs (\d\.\d\d)× over 20,000 tokens \((\d\.\d\d)× at 4K\), against "
            r"(\d\.\d\d)× for "
                 r"one step from 8 to 4 bits \(the intervals apart, \[(\d\.\d+), (\d\.\d+)\] against \[(\d\.\d+), "
                 r"(\d\.\d+)\]\): about (\d\.\d)-(\d\.\d) such steps in log terms\. .*? 2 bits collapses \((\d+)× on "
                 r"`sink4\+window`, (\d+)× on the full cache\), .*? that alone costs the (\d+)%"))
    check(gap, sink_gap(step), "Gemma 3's sink gap at 20K")
    check(earlier, sink_gap("Gemma 3 at 4K"), "Gemma 3's sink gap at 4K")
    four = [ratio((name, a), (name, b)) for a, b in EIGHT_TO_FOUR]
    assert all(matches(four_, r[0]) for r in four), four
    found = ratio((name, "window"), (name, "sink4+window"))
    check(gap_low, found[1], "the bottom of the gap's interval")
    check(gap_high, found[2], "the top of the gap's interval")
    check(four_low, min(r[1] for r in four), "the bottom of the 8 → 4 intervals")
    check(four_high, max(r[2] for r in four), "the top of the 8 → 4 intervals")
    check(steps_low, logs(sink_gap(step), max(r[0] for r in four)), "the gap in the larger step")
    check(steps_high, logs(sink_gap(step), min(r[0] for r in four)), "the gap in the smaller step")
    check(two_window, ratio((name, "q2+sink4+window"), (name, "q4+sink4+window"))[0], "4 → 2 on sink4+window")
    check(two_full, ratio((name, "q2+full"), (name, "q4+full"))[0], "4 → 2 on the full cache")
    check(share, 100 * (sink_gap(step) - 1), "what losing token 0 costs")


# --- model time: what the records' batches took ------------------------------------------------------------------


def batch_seconds(name: str, labels=None, budgets=None) -> list[float]:
    """The seconds of each batch of a file's perplexity rows (rows of one batch record the batch's time), of the rows
    named `labels` or at `budgets` where given; the full cache's not among them."""
    return sorted({r["batch_seconds"] for r in lines(name) if "ppl" in r and r.get("kind") == "policy"
                   and (labels is None or r["label"] in labels) and (budgets is None or r["budget"] in budgets)})


def command_minutes(name: str, **which) -> float:
    """Model time of one command of a run: its batches and its full-cache reference."""
    return (sum(batch_seconds(name, **which)) + full(name)["batch_seconds"]) / 60


CLAIM_ROWS = ["window", "sink4+window", *(f"q{b}+{r}" for b in (8, 4, 2) for r in ("sink4+window", "full"))]


def test_model_time_of_the_claims():
    total, shortest, longest = said(text(), r"\(About (\d\.\d) min of model time: the full cache and 7 batches of "
                                            r"(\d+)-(\d+) s each\.\)")
    name = "quant-claim-4k.jsonl"
    batches = batch_seconds(name, CLAIM_ROWS)
    assert len(batches) == 7
    check(total, command_minutes(name, labels=CLAIM_ROWS), "the claim's model time")
    check(shortest, min(batches), "its shortest batch")
    check(longest, max(batches), "its longest batch")
    per_token, least, most = said(text(), r"\(about (\d\.\d\d) s a token on SmolLM2 on 2 CPU cores at a budget of "
                                          r"1,024, (\d+)-(\d+) minutes a row at 4,096 tokens\)")
    slow = [DEPLOYED + "sink4+window", DEPLOYED + "full", KIVI + "sink4+window", KIVI + "full"]
    for spec in slow[::2]:
        check(per_token, 1 / row(name, spec)["tokens_per_s"], f"{spec}'s seconds a token")
    check(least, min(batch_seconds(name, slow)) / 60, "the quickest row through a residual")
    check(most, max(batch_seconds(name, slow)) / 60, "the slowest")
    minutes = said(text(), r"added to the same folder \((\d+\.\d) and (\d+\.\d) min: a stream through a residual is "
                           r"read one token per forward\), .*? \((\d\.\d) and (\d\.\d) min\)")
    for written, spec in zip(minutes, slow, strict=True):
        check(written, row(name, spec)["batch_seconds"] / 60, f"{spec}'s minutes")
    total, shortest, longest = said(text(), r"quant-claim-4k-gemma3` \((\d\.\d) min: (\d+)-(\d+) s per batch\)")
    name = "quant-claim-4k-gemma3.jsonl"
    check(total, command_minutes(name), "Gemma 3's claim at 4K")
    check(shortest, min(batch_seconds(name)), "its shortest batch")
    check(longest, max(batch_seconds(name)), "its longest batch")
    cache_mode, original = said(text(), r"\((\d+) and (\d+) min of model time on 2 cores\.\) Records: "
                                        r"`docs/results/quant-claim-20k-cache\.jsonl`")
    check(cache_mode, command_minutes("quant-claim-20k-cache.jsonl"), "the 20K claim in position-shift mode")
    check(original, command_minutes("quant-claim-20k.jsonl"), "the 20K claim in original positions")
    total, plain, bounded_low, bounded_high, full_low, full_high = said(text(), (
        r"\((\d+) min of model time on 2 cores: (\d\.\d) min for the 16-bit batch, (\d\.\d)-(\d\.\d) min for each "
        r"bounded quantized row, (\d\.\d)-(\d+\.\d) min for each quantized full cache\.\)"))
    name = "quant-claim-20k-gemma3.jsonl"
    check(total, command_minutes(name), "Gemma 3's claim at 20K")
    check(plain, batch_seconds(name, ["window", "sink4+window"])[0] / 60, "its 16-bit batch")
    bounded = batch_seconds(name, [f"q{b}+sink4+window" for b in (8, 4, 2)])
    check(bounded_low, min(bounded) / 60, "its quickest bounded quantized row")
    check(bounded_high, max(bounded) / 60, "its slowest bounded quantized row")
    whole = batch_seconds(name, [f"q{b}+full" for b in (8, 4, 2)])
    check(full_low, min(whole) / 60, "its quickest quantized full cache")
    check(full_high, max(whole) / 60, "its slowest quantized full cache")


#: the equal-bytes runs' commands, by the budgets each ran
BYTES_COMMANDS = [(512, 1024), (910, 1820), (1638, 3276), (1024, 2048)]


def test_model_time_at_equal_bytes():
    *each, shortest, longest, first, second = said(text(), (
        r"\((\d\.\d), (\d\.\d), (\d\.\d) and (\d\.\d) min of model time: (\d+)-(\d+) s per batch of four rows; "
        r"the last "
        r"command (\d+\.\d) and (\d+\.\d) min"))
    name = "quant-bytes-4k.jsonl"
    plain = [s for s in ("", "q8+", "q4+", "fp8+")]
    for written, prefix, budgets in zip(each, plain, BYTES_COMMANDS, strict=True):
        labels = [prefix + p for p in ("sink4+window", "h2o", "tova", "snapkv")]
        check(written, command_minutes(name, labels=labels, budgets=budgets), f"the run at {budgets}")
    four = [s for prefix, budgets in zip(plain, BYTES_COMMANDS)
            for s in batch_seconds(name, [prefix + "h2o"], budgets)]
    check(shortest, min(four), "the quickest batch of four rows")
    check(longest, max(four), "the slowest")
    deployed = batch_seconds(name, [DEPLOYED + "h2o"])
    check(first, deployed[0] / 60, "the deployed rows at 1,365")
    check(second, deployed[1] / 60, "the deployed rows at 3,185")
    (total,) = said(text(), r"\(About (\d+) min of model time on 2 cores\.\) Records: "
                            r"`docs/results/quant-bytes-4k-gemma3\.jsonl`")
    name = "quant-bytes-4k-gemma3.jsonl"
    runs = [command_minutes(name, budgets=budgets, labels=labels) for budgets, labels in (
        ((438, 1186), ["sink4+window", "h2o", "tova", "snapkv"]),
        ((1140, 2766), [f"q8+{p}" for p in ("sink4+window", "h2o", "tova", "snapkv", "full")]),
        ((2766,), [f"q4+{p}" for p in ("sink4+window", "h2o", "tova", "snapkv", "full")]))]
    check(total, sum(runs), "Gemma 3's equal-bytes runs")
    *answering, reference = said(text(), r"\((\d\.\d), (\d\.\d) and (\d\.\d) min of answering, and (\d\.\d) min "
        r"for the "
                                         r"full cache's answers\.\)")
    for written, budgets in zip(answering, (("256", "512"), ("455", "910"), ("819", "1638")), strict=True):
        check(written, answer_minutes(budgets), f"the needle at {budgets}")
    check(reference, answer_minutes(("full",)), "the full cache's needles")


def answer_minutes(budgets: tuple[str, ...]) -> float:
    """Minutes of answering at `budgets` in the needle's records: the answers of one prompt at one budget are rows of
    one batch and record its seconds."""
    batches = {(r["budget"], r["sample"]): r["seconds"] for r in lines("quant-niah-2k.jsonl") if r["budget"] in budgets}
    return sum(batches.values()) / 60


# --- at equal bytes, SmolLM2: the three tables, the report's comparisons, what it says --------------------------

BYTES = "quant-bytes-4k.jsonl"
WIDTHS = {"16 bits": "", "q8": "q8+", "q4": "q4+", "fp8": "fp8+", "q4 as deployed": DEPLOYED}
CELL = r"(\d+\.\d\d), " + INTERVAL
#: the tables at equal bytes, by the line each follows
BYTES_TABLES = ("PPL / full with its paired 95% interval:", "`fp8` (128 bytes an entry at head_dim 64",
                "4 bits as deployed (`q4:group=64,residual=128`: 72 bytes an entry")


def against_full(name: str, label: str, budget: int) -> tuple[float, float, float]:
    return paired((name, row(name, label, budget)), (name, full(name)))


def bytes_cells() -> list[tuple[str, str, int, str]]:
    """Every cell of the three tables: (share, spec, budget, cell as written)."""
    out = []
    for anchor in BYTES_TABLES:
        header, rows = headed_table(PATH, anchor)
        for cells in rows:
            for column, cell in zip(header[1:], cells[1:], strict=True):
                share, _, rest = column.partition(": ")
                width, _, budget = rest.rpartition(", ")
                out.append((share, WIDTHS[width] + cells[0], int(budget), cell))
    return out


def test_every_cell_at_equal_bytes_is_its_records():
    (reference,) = said(text(), r"PPL \(full cache (\d+\.\d\d)\) and PPL / full")
    check(reference, full(BYTES)["ppl"], "the full cache over 4,096 tokens")
    cells = bytes_cells()
    assert len(cells) == 4 * 6 + 4 * 2 + 4 * 2
    for _, spec, budget, cell in cells:
        ppl_text, *interval = re.fullmatch(CELL, cell.strip("*")).groups()
        check(ppl_text, row(BYTES, spec, budget)["ppl"], f"{spec} at {budget}")
        check_interval(tuple(interval), against_full(BYTES, spec, budget), f"{spec} at {budget} against the full cache")
    for share in ("25%", "12.5%"):  # in bold the lowest row of each size, of all five widths
        mine = [(row(BYTES, spec, budget)["ppl"], cell.startswith("**"))
                for s, spec, budget, cell in cells if s == share]
        assert [bold for _, bold in mine] == [ppl == min(p for p, _ in mine) for ppl, _ in mine], share


def test_the_bytes_each_share_holds():
    whole, q8_, q4_, quarter, eighth, within = said(text(), (
        r"A quarter and an eighth of the full bf16 cache \((\d+) MiB per sequence over 4,096 tokens\): 16 bits at "
        r"1,024 and 512 entries, q8 at (1,820) and 910, q4 at (3,276) and 1,638\. Bytes per sequence at bf16 as "
        r"measured at the end of the stream: ([\d./ ]+) MiB and ([\d./ ]+) MiB \(within (\d\.\d\d)%\)"))
    check(whole, bytes_of(BYTES, "full"), "the full cache's bytes")
    assert (number(q8_), number(q4_)) == (1820, 3276)
    for written, budgets in ((quarter, (1024, 1820, 3276)), (eighth, (512, 910, 1638))):
        held = [mib(row(BYTES, f"{prefix}h2o", budget)) for prefix, budget in zip(("", "q8+", "q4+"), budgets)]
        for text_, value in zip(written.split(" / "), held, strict=True):
            check(text_, value, f"the bytes at {budgets}")
        assert 100 * (max(held) / min(held) - 1) <= number(within)
    share, q4_full = said(text(), r"its scales and zero points make it (\d+)% of the bf16 cache, `q4\+full` "
                                  r"(\d+\.\d\d) MiB\.\)")
    claim = "quant-claim-4k.jsonl"
    check(q4_full, bytes_of(claim, "q4+full"), "q4+full's bytes")
    check(share, 100 * bytes_of(claim, "q4+full") / bytes_of(claim, "full"), "its share of the bf16 cache")


def comparisons() -> list[str]:
    """The report's comparisons at equal bytes quoted in the SmolLM2 section, each as one line."""
    quoted = re.findall(r"> (At equal bytes, .*?)(?= > At equal bytes| What it says)", text())
    assert len(quoted) == 2
    return [" ".join(q.replace(" > ", " ").replace(">", " ").split()).rstrip() for q in quoted]


def spec_budget(item: str) -> tuple[str, int]:
    spec, budget = item.rsplit(" at ", 1)
    return spec, int(budget)


def test_the_reports_comparisons_at_equal_bytes():
    for line in comparisons():
        low_mib, high_mib, lowest, lowest_ppl, apart, rest = re.fullmatch(
            r"At equal bytes, ([\d.]+)(?:-([\d.]+))? MiB per sequence \(bf16\): lowest PPL (\S+ at \d+) "
            r"\((\d+\.\d\d)\), "
            r"not told apart from (.*?); PPL against it: (.*)\.", line).groups()
        spec, budget = spec_budget(lowest)
        best = (BYTES, row(BYTES, spec, budget))
        check(lowest_ppl, best[1]["ppl"], lowest)
        items = re.findall(r"(\S+ at \d+) ×" + INTERVAL, rest)
        group = [best[1]] + [row(BYTES, *spec_budget(item)) for item, *_ in items]
        held = [mib(r) for r in group]
        check(low_mib, min(held), "the group's fewest bytes")
        check(high_mib or low_mib, max(held), "the group's most bytes")
        assert best[1]["ppl"] == min(r["ppl"] for r in group), "the lowest is the lowest"
        alike = [r for r in lines(BYTES) if r.get("kind") == "policy" and abs(mib(r) / mib(best[1]) - 1) <= 0.05]
        assert len(group) == len(alike), "every row within 5% of its bytes"
        tied = []
        for item, *written in items:
            found = paired((BYTES, row(BYTES, *spec_budget(item))), best)
            check_interval(tuple(written), found, f"{item} against {lowest}")
            if found[1] <= 1:
                tied.append(item)
        assert sorted(apart.split(", ")) == sorted(tied), "not told apart: the rows whose interval holds 1"


def test_what_it_says_at_equal_bytes_on_smollm2():
    d, d_low, d_high, q8, q8_low, q8_high, tie, tie_low, tie_high = said(text(), (
        r"At an eighth of the cache, `q4:group=64,residual=128\+h2o` at 1,365 entries \(" + INTERVAL + r" against the "
        r"full cache\) and `q8\+h2o` at 910 \(" + INTERVAL + r"\) are not told apart \(×" + INTERVAL + r"\)"))
    check_interval((d, d_low, d_high), against_full(BYTES, DEPLOYED + "h2o", 1365), "the deployed q4+h2o at 1,365")
    check_interval((q8, q8_low, q8_high), against_full(BYTES, "q8+h2o", 910), "q8+h2o at 910")
    check_interval((tie, tie_low, tie_high), paired((BYTES, row(BYTES, "q8+h2o", 910)),
                                                    (BYTES, row(BYTES, DEPLOYED + "h2o", 1365))), "the tie")
    eighth = [(spec, budget) for share, spec, budget, _ in bytes_cells() if share == "12.5%"]
    inside = {(s, b) for s, b in eighth if against_full(BYTES, s, b)[2] <= 1.05}
    assert inside == {(DEPLOYED + p, 1365) for p in ("h2o", "tova", "sink4+window")} | {("q8+h2o", 910)}, inside
    behind, low, high, q4_behind = said(text(), r"16-bit `h2o` at 512 is (\d\.\d)% worse than `q8\+h2o` \[(\d\.\d)%, "
                                                r"(\d\.\d)%\], `q4\+h2o` at 1,638 \(no residual\) (\d\.\d)% worse")
    q8_910 = (BYTES, row(BYTES, "q8+h2o", 910))
    found = paired((BYTES, row(BYTES, "h2o", 512)), q8_910)
    check_interval((behind, low, high), tuple(100 * (v - 1) for v in found), "h2o at 512 behind q8+h2o at 910")
    check(q4_behind, 100 * (paired((BYTES, row(BYTES, "q4+h2o", 1638)), q8_910)[0] - 1), "q4+h2o at 1,638")
    lowest, lowest_low, lowest_high, least, most = said(text(), (
        r"At a quarter the deployed 4-bit `sink4\+window` at 3,185 is lowest "
        r"\(" + INTERVAL + r"\), not told apart from "
        r"the other deployed 4-bit rows but SnapKV, the 8-bit ones and 16-bit `h2o` at 1,024; the 16-bit rows are "
        r"(\d\.\d)-(\d\.\d)% behind `q8\+h2o` at 1,820, each interval above 1"))
    check_interval((lowest, lowest_low, lowest_high), against_full(BYTES, DEPLOYED + "sink4+window", 3185), "lowest")
    q8_1820 = (BYTES, row(BYTES, "q8+h2o", 1820))
    plain = [paired((BYTES, row(BYTES, p, 1024)), q8_1820) for p in ("sink4+window", "h2o", "tova")]
    check(least, 100 * (min(r[0] for r in plain) - 1), "the 16-bit row nearest q8+h2o at 1,820")
    check(most, 100 * (max(r[0] for r in plain) - 1), "the 16-bit row furthest from it")
    assert all(r[1] > 1 for r in plain), "each interval above 1"
    fp8, fp8_low, fp8_high, quarter, quarter_low, quarter_high = said(text(), (
        r"At an eighth of the cache `fp8\+h2o` at 1,024 entries is (\d\.\d)% behind `q8\+h2o` at 910 \[(\d\.\d)%, "
        r"(\d\.\d)%\] and ahead of 16-bit `h2o` at 512; at a quarter `fp8\+sink4\+window` at 2,048 is (\d\.\d)% behind "
        r"the lowest row \[(\d\.\d)%, (\d\.\d)%\]"))
    found = paired((BYTES, row(BYTES, "fp8+h2o", 1024)), q8_910)
    check_interval((fp8, fp8_low, fp8_high), tuple(100 * (v - 1) for v in found), "fp8+h2o behind q8+h2o")
    assert paired((BYTES, row(BYTES, "fp8+h2o", 1024)), (BYTES, row(BYTES, "h2o", 512)))[2] < 1, "ahead of h2o at 512"
    found = paired((BYTES, row(BYTES, "fp8+sink4+window", 2048)), (BYTES, row(BYTES, DEPLOYED + "sink4+window", 3185)))
    check_interval((quarter, quarter_low, quarter_high), tuple(100 * (v - 1) for v in found), "fp8 at a quarter")
    least, most, step_low, step_high, deployed = said(text(), (
        r"at both sizes \((\d\.\d)-(\d\.\d)% behind the lowest row\): its 8→4 step costs (\d)-(\d)% \(the claim row "
        r"above\), .*? the step costs under (\d)%"))
    behind_lowest = []
    for budgets, best in (((3276, 3185), (DEPLOYED + "sink4+window", 3185)), ((1638, 1365), (DEPLOYED + "h2o", 1365))):
        for p in ("sink4+window", "h2o", "tova"):
            behind_lowest.append(paired((BYTES, row(BYTES, "q4+" + p, budgets[0])), (BYTES, row(BYTES, *best)))[0])
    check(least, 100 * (min(behind_lowest) - 1), "the q4 row nearest the lowest")
    check(most, 100 * (max(behind_lowest) - 1), "the q4 row furthest from it")
    four = steps_between("SmolLM2 at 4K", EIGHT_TO_FOUR)
    check(step_low, 100 * (min(four) - 1), "the smaller 8 → 4 step")
    check(step_high, 100 * (max(four) - 1), "the larger 8 → 4 step")
    assert 100 * (max(steps_between("SmolLM2 at 4K", AS_DEPLOYED)) - 1) < number(deployed)
    alone, q4_, d_, d_low, d_high, eighth_low, eighth_high = said(text(), (
        r"far behind at 1,024 entries \((\d\.\d\d)\); giving it 3\.2× the entries at 4 bits cuts that to "
        r"(\d\.\d\d), and "
        r"3\.1× at 4 bits as deployed to " + INTERVAL.replace(r"\d+\.?\d*", r"\d\.\d\d") + r"\. At an eighth no width "
        r"saves it \((\d\.\d\d)-(\d\.\d\d)\)"))
    check(alone, against_full(BYTES, "snapkv", 1024)[0], "snapkv at 1,024")
    check(q4_, against_full(BYTES, "q4+snapkv", 3276)[0], "q4+snapkv at 3,276")
    check_interval((d_, d_low, d_high), against_full(BYTES, DEPLOYED + "snapkv", 3185), "the deployed snapkv")
    assert round(3276 / 1024, 1) == 3.2 and round(3185 / 1024, 1) == 3.1
    snap = [against_full(BYTES, spec, budget)[0] for share, spec, budget, _ in bytes_cells()
            if share == "12.5%" and spec.endswith("snapkv")]
    check(eighth_low, min(snap), "snapkv's best width at an eighth")
    check(eighth_high, max(snap), "its worst")


# --- at equal bytes on retrieval ------------------------------------------------------------------------------


def test_every_cell_of_the_needle_at_equal_bytes():
    header, rows = headed_table(PATH, "min of answering, and")
    for cells in rows:
        for column, cell in zip(header[1:], cells[1:], strict=True):
            width, _, budget = column.partition(": ")[2].rpartition(", ")
            policy = WIDTHS[width] + cells[0]
            hits, n = needle(policy, budget)
            rate, low, high = re.fullmatch(INTERVAL, cell.strip("*")).groups()
            check_interval((rate, low, high), (hits / n, *wilson(hits, n)), f"{policy} at {budget}")
    hits, n, rate, low, high = said(text(), r"The full cache answers (\d+)/(\d+), " + INTERVAL)
    assert needle("full", "full") == (int(hits), int(n))
    check_interval((rate, low, high), (int(hits) / int(n), *wilson(int(hits), int(n))), "the full cache's needles")


def test_what_the_needle_says_at_equal_bytes():
    q8, n, plain, n_plain, bound, agreeing, q4_eighth, n_eighth, plain_eighth, n_plain_eighth = said(text(), (
        r"At a quarter, `q4\+tova` and `q8\+tova` answer (\d+)/(\d+) where 16-bit TOVA answers "
        r"(\d+)/(\d+)\..*? agreeing with the full cache on all 20 bounds the drop only within ±(\d\.\d\d) .*? "
        r"and (\d+) "
        r"agreeing prompts would show 5 points\. At an eighth `q4\+tova` answers (\d+)/(\d+) against (\d+)/(\d+) "
        r"for 16 "
        r"bits \(intervals apart\)"))
    assert needle("q4+tova", "1638") == needle("q8+tova", "910") == (int(q8), int(n))
    assert needle("tova", "512") == (int(plain), int(n_plain))
    check(bound, bonett_price_half_width(int(n)), "the drop's bound when all 20 agree")
    assert bonett_price_half_width(int(agreeing)) <= 0.05 < bonett_price_half_width(int(agreeing) - 1)
    four, sixteen = needle("q4+tova", "819"), needle("tova", "256")
    assert four == (int(q4_eighth), int(n_eighth)) and sixteen == (int(plain_eighth), int(n_plain_eighth))
    assert wilson(*sixteen)[1] < wilson(*four)[0], "intervals apart"
    for wider, narrower, apart in ((("q4+sink4+window", "1638"), ("sink4+window", "512"), True),
                                   (("q4+sink4+window", "819"), ("sink4+window", "256"), False)):
        assert needle(*wider)[0] > needle(*narrower)[0], "the 4-bit row ahead"
        assert (wilson(*needle(*narrower))[1] < wilson(*needle(*wider))[0]) == apart
    assert all(needle(prefix + "snapkv", budget)[0] == 0 for prefix, budget in (
        ("", "256"), ("", "512"), ("q8+", "455"), ("q8+", "910"), ("q4+", "819"), ("q4+", "1638"))), "no needle"


def bonett_price_half_width(agreeing: int) -> float:
    """Half the width of Bonett and Price's 95% interval of a paired difference of proportions when all `agreeing`
    pairs agree (no discordant pair): the adjusted Wald interval, (b + 1) / (n + 2) for each discordant share."""
    share = 1 / (agreeing + 2)
    return 1.959964 * math.sqrt(2 * share / (agreeing + 2))


# --- Gemma 3 at equal bytes -------------------------------------------------------------------------------------

GEMMA = "quant-bytes-4k-gemma3.jsonl"


def gemma_row(spec: str, budget: int | None) -> dict:
    """A row of Gemma 3's equal-bytes records: a quantized full cache whatever the budget it ran beside."""
    return row(GEMMA, spec) if spec.endswith("+full") else row(GEMMA, spec, budget)


def test_every_cell_of_gemma3_at_equal_bytes():
    header, rows = headed_table(PATH, "(About 19 min of model time")
    columns = []
    for column in header[1:]:
        share, _, rest = column.partition(": ")
        spec = rest.strip("`") if rest.startswith("`") else None
        width, _, budget = rest.rpartition(", ")
        columns.append((share, spec, None if spec else WIDTHS[width], None if spec else int(budget)))
    *policies, held = rows
    assert held[0] == "KV MiB/seq bf16"
    whole = bytes_of(GEMMA, "full")
    for (share, spec, prefix, budget), cell in zip(columns, held[1:], strict=True):
        found = mib(gemma_row(spec or prefix + "sink4+window", budget))
        check(cell, found, f"the bytes at {share}")
        check(share.rstrip("%"), 100 * found / whole, f"the share {share}")
    for cells in policies:
        for (_, spec, prefix, budget), cell in zip(columns, cells[1:], strict=True):
            if spec:  # the quantized full cache is one row, written on the first line
                if cells[0] == policies[0][0]:
                    written = re.fullmatch(INTERVAL, cell.strip("*")).groups()
                    check_interval(written, paired((GEMMA, gemma_row(spec, None)), (GEMMA, full(GEMMA))), spec)
                else:
                    assert cell in ("", "(one row)"), cell
                continue
            written = re.fullmatch(INTERVAL, cell.strip("*")).groups()
            found = paired((GEMMA, gemma_row(prefix + cells[0], budget)), (GEMMA, full(GEMMA)))
            check_interval(written, found, f"{prefix}{cells[0]} at {budget}")
    (reference,) = said(text(), r"\(full (\d+\.\d\d)\) with its paired 95% interval; the bf16 bytes")
    check(reference, full(GEMMA)["ppl"], "Gemma 3's full cache over 4,096 tokens")
    whole_written, at56, at45, at31, at25 = said(text(), (
        r"at least 38% of the full cache's (\d+\.\d\d) MiB \(bf16\).*? the levels compared here are those at which two "
        r"widths meet: (\d+)% \(`q8\+full` against 16 bits at 1,186 entries\), (\d+)% \(16 bits at 438 against q8 at "
        r"2,766\) and (\d+)% \(`q4\+full` against q8 at 1,140\); q4 at 2,766 entries \((\d+)%\)"))
    check(whole_written, whole, "Gemma 3's full cache's bytes")
    for written, spec, budget in ((at56, "q8+full", None), (at56, "sink4+window", 1186), (at45, "sink4+window", 438),
                                  (at45, "q8+sink4+window", 2766), (at31, "q4+full", None),
                                  (at31, "q8+sink4+window", 1140), (at25, "q4+sink4+window", 2766)):
        check(written, 100 * mib(gemma_row(spec, budget)) / whole, f"{spec} at {budget}'s share")


def gemma_comparisons() -> list[str]:
    quoted = re.findall(r"> (At \d+\.\d+ MiB: .*?)(?= > At \d| \* \*\*8 bits)", text())
    assert len(quoted) == 3
    return [" ".join(q.replace(" > ", " ").split()).rstrip(" >") for q in quoted]


def test_gemma3s_comparisons_at_equal_bytes():
    for line in gemma_comparisons():
        held, lowest, lowest_budget, lowest_ppl, tied, rest = re.fullmatch(
            r"At (\d+\.\d+) MiB: lowest `?([^` ]+)`?(?: at (\d+))? \((\d+\.\d\d)\)(?:, not told apart from (.*?))?; "
            r"(.*)\.", line).groups()
        budget = int(lowest_budget) if lowest_budget else None
        best = gemma_row(lowest, budget)
        check(lowest_ppl, best["ppl"], lowest)
        check(held, mib(best), "the level's bytes")
        named = [(spec, budget) for spec in (tied.split(", ") if tied else [])]
        for spec, at, *written in re.findall(r"(\S+?)(?: at (\d+))? ×" + INTERVAL, rest):
            budget = int(at) if at else budget
            found = paired((GEMMA, gemma_row(spec, budget)), (GEMMA, best))
            check_interval(tuple(written), found, f"{spec} at {budget} against {lowest}")
            assert found[1] > 1, f"{spec}: beyond the noise"
            named.append((spec, None if spec.endswith("+full") else budget))
        for spec, at in named[:len(tied.split(", ")) if tied else 0]:
            assert paired((GEMMA, gemma_row(spec, at)), (GEMMA, best))[1] <= 1, f"{spec}: not told apart"
        alike = {(r["label"], None if r["label"].endswith("+full") else r["budget"]) for r in lines(GEMMA)
                 if r.get("kind") == "policy" and abs(mib(r) / mib(best) - 1) <= 0.05}
        assert alike == {(lowest, None if lowest.endswith("+full") else int(lowest_budget))} | set(named), line


def test_what_gemma3_says_at_equal_bytes():
    low56, high56, low45, high45, at31, four = said(text(), (
        r"The 8-bit rows of a level are ahead of the 16-bit rows \((\d)-(\d)% at 56%, (\d\.\d)-(\d\.\d)% at "
        r"45%\) and of the 4-bit "
        r"rows \((\d)% at 31%\): .*? \*\*4 bits costs (\d+)% on Gemma 3\*\*"))
    q8_full = (GEMMA, gemma_row("q8+full", None))
    level56 = [paired((GEMMA, gemma_row(p, 1186)), q8_full)[0] for p in ("sink4+window", "h2o", "tova")]
    check(low56, 100 * (min(level56) - 1), "the 16-bit rows nearest at 56%")
    check(high56, 100 * (max(level56) - 1), "the 16-bit rows furthest at 56%")
    best45 = (GEMMA, gemma_row("q8+sink4+window", 2766))
    level45 = [paired((GEMMA, gemma_row(p, 438)), best45)[0] for p in ("sink4+window", "h2o", "tova")]
    check(low45, 100 * (min(level45) - 1), "the 16-bit rows nearest at 45%")
    check(high45, 100 * (max(level45) - 1), "the 16-bit rows furthest at 45%")
    best31 = (GEMMA, gemma_row("q8+h2o", 1140))
    check(at31, 100 * (paired((GEMMA, gemma_row("q4+full", None)), best31)[0] - 1), "q4+full at 31%")
    quantized = [paired((GEMMA, gemma_row("q4+" + p, 2766)), (GEMMA, full(GEMMA)))
                 for p in ("sink4+window", "h2o", "tova", "full")]
    assert all(matches(four, 100 * (r[0] - 1)) for r in quantized), quantized
    every = quantized + [paired((GEMMA, gemma_row("q4+snapkv", 2766)), (GEMMA, full(GEMMA)))]
    assert all(r[1] > 1.05 for r in every), "no 4-bit row within 5% of the full cache"



def test_what_is_held_and_what_a_residual_costs_in_time():
    q4_, q8_, q2_ = said(text(), r"80 bytes per entry at bf16 against 256, i\.e\. (\d+)% of the bf16 cache; `q8`: "
                                 r"(\d+)%; `q2`: (\d+)%")
    name = "quant-claim-4k.jsonl"  # the whole cache at each width, over the same 4,096 tokens
    for written, width in ((q4_, "q4"), (q8_, "q8"), (q2_, "q2")):
        check(written, 100 * bytes_of(name, f"{width}+full") / bytes_of(name, "full"), f"{width}'s share")
    per_token, per_100 = said(text(), r"\((\d+) ms a token on SmolLM2 on 2 CPU cores over 1,000 tokens, "
                                      r"(\d+) s per 100 tokens, and three times that with `keys=channel`")
    alone = {line.split()[0]: float(line.split()[3]) for line in
             (RESULTS / "quant-gap-ppl-1000.txt").read_text().splitlines() if not line.startswith("#")}
    ring = alone["q4:residual=128+full"] / 1000  # seconds a token, 1,000 tokens read one per forward
    check(per_token, 1000 * ring, "a token through a residual")
    check(per_100, 100 * ring, "100 tokens through a residual")
    assert round(alone["q4:group=64,keys=channel+full"] / alone["q4:residual=128+full"]) == 3, "three times that"

# --- the checks themselves ------------------------------------------------------------------------------------

#: each check above, and a figure of the doc it reads, changed: the check must fail
CHANGED = [
    (test_every_step_table_row_is_its_records, ("SmolLM2 at 4K",), "| 24.65 → 36.93 |", "| 24.65 → 36.94 |"),
    (test_every_step_table_row_is_its_records, ("Gemma 3 at 4K",),
     "**1.166 [1.126, 1.207]**", "**1.167 [1.126, 1.207]**"),
    (test_every_step_table_row_is_its_records, ("SmolLM2 at 20K",), "| 79.11 → 79.05 |", "| 79.11 → 79.15 |"),
    (test_every_step_table_row_is_its_records, ("Gemma 3 at 20K",), "40.1 [37.1, 43.3]", "40.2 [37.1, 43.3]"),
    (test_what_each_step_of_bits_costs, (),
     "1.017 [1.009, 1.024] on the full cache", "1.018 [1.009, 1.024] on the full cache"),
    (test_what_four_bits_cost_as_deployments_run_them, (),
     "without that residual 4.7–14%", "without that residual 4.8–14%"),
    (test_is_losing_the_sink_worse_than_a_step_of_bits, (),
     "1.50× at 4K and 1.65× at 20K", "1.51× at 4K and 1.65× at 20K"),
    (test_at_equal_memory_on_perplexity_and_on_retrieval, (),
     "answers 16/20 single needles", "answers 17/20 single needles"),
    (test_four_bits_against_quantized_cache, (), "| 26.256 | 1.0059× |", "| 26.257 | 1.0059× |"),
    (test_what_four_bits_cost_is_mostly_the_residual, (),
     "| 1.140 [1.099, 1.182] | 6.18 |", "| 1.141 [1.099, 1.182] | 6.18 |"),
    (test_the_sink_gap_against_one_level_on_smollm2_at_4k, (), "1.091 = 1.028 × 1.062", "1.092 = 1.028 × 1.062"),
    (test_four_bits_as_deployed_at_4k, (), "about 57-121 steps", "about 58-121 steps"),
    (test_gemma3_at_4k, (), "about 1.6-1.8 steps", "about 1.6-1.9 steps"),
    (test_smollm2_at_20k, (), "0.560 [0.345, 0.904]", "0.561 [0.345, 0.904]"),
    (test_gemma3_at_20k, (), "costs the 22%", "costs the 23%"),
    (test_model_time_of_the_claims, (), "(8.3 and 11.3 min", "(8.3 and 11.4 min"),
    (test_model_time_at_equal_bytes, (), "the last command 14.6 and 16.3", "the last command 14.7 and 16.3"),
    (test_every_cell_at_equal_bytes_is_its_records, (), "25.66, 1.070 [1.052, 1.089]", "25.67, 1.070 [1.052, 1.089]"),
    (test_the_bytes_each_share_holds, (), "22.50 / 22.49 / 22.49 MiB", "22.51 / 22.49 / 22.49 MiB"),
    (test_the_reports_comparisons_at_equal_bytes, (),
     "q8+tova at 910 ×1.012 [1.002, 1.026]", "q8+tova at 910 ×1.013 [1.002, 1.026]"),
    (test_what_it_says_at_equal_bytes_on_smollm2, (), "are 0.6-1.6% behind", "are 0.6-1.7% behind"),
    (test_every_cell_of_the_needle_at_equal_bytes, (), "| 0.45 [0.26, 0.66] |", "| 0.50 [0.26, 0.66] |"),
    (test_what_the_needle_says_at_equal_bytes, (), "within ±0.13", "within ±0.12"),
    (test_every_cell_of_gemma3_at_equal_bytes, (), "| 1.106 [1.067, 1.154] |", "| 1.107 [1.067, 1.154] |"),
    (test_gemma3s_comparisons_at_equal_bytes, (), "q8+snapkv ×1.090 [1.057, 1.129]", "q8+snapkv ×1.091 [1.057, 1.129]"),
    (test_what_gemma3_says_at_equal_bytes, (), "(8% at 31%)", "(9% at 31%)"),
    (test_what_is_held_and_what_a_residual_costs_in_time, (), "`q8`: 56%", "`q8`: 57%"),
]


def test_every_check_above_is_listed_here():
    listed = {check_.__name__ for check_, *_ in CHANGED}
    assert listed == {name for name in globals() if name.startswith("test_") and name not in (
        "test_every_check_above_is_listed_here", "test_a_changed_figure_fails_its_check")}


@pytest.mark.parametrize("check_,args,old,new", CHANGED, ids=[f"{c.__name__}{a}" for c, a, *_ in CHANGED])
def test_a_changed_figure_fails_its_check(check_, args, old, new):
    with changed(PATH, old, new), pytest.raises(AssertionError):
        check_(*args)
