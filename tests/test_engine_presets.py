"""Engine presets against hand-worked traces of each engine's own arithmetic.

For every preset, a few lines below simulate the engine as its source does it (cited in
`docs/engines.md`), on a 20-token stream with a context (the budget) of 8: which stream
positions sit in the cache after each step. The cache running the preset on a tiny model,
token by token and in chunks, must hold exactly those positions. The simulations never
call a policy: they are the engines' bookkeeping written out in lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvevict import EvictingCache, KvevictError, parse_policy
from kvevict.eval.forward import body
from kvevict.policies import REGISTRY, Policy, SlotView, check_policy, register

from conftest import make_tiny, random_tokens

MODEL = make_tiny(seed=41, layers=2)
T = 20
CTX = 8
TOKENS = random_tokens(T, seed=42)


# --- the engines, written out ------------------------------------------------------------


def llama_server(n_ctx: int, keep: int, add_bos: bool) -> list[list[int]]:
    """llama-server: before decoding a token, if `held + 1 >= n_ctx`, keep `n_keep` (+1 for BOS, at
    most n_ctx - 4), drop the next `(held - n_keep) // 2` (at most `held - n_keep - 1`), slide the rest.
    Returns the cells held between token t and token t+1, for every t."""
    n_keep = min(keep + int(add_bos), n_ctx - 4)
    cells: list[int] = []
    between = []
    for t in range(T + 1):
        if len(cells) + 1 >= n_ctx:
            left = len(cells) - n_keep
            discard = max(0, min(left // 2, left - 1))
            del cells[n_keep : n_keep + discard]
        if t:
            between.append(list(cells))
        if t < T:
            cells.append(t)
    return between


def window_with_sinks(window: int, sinks: int) -> list[list[int]]:
    """MLC / TensorRT-LLM / SinkCache: a token attends to the sinks and the most recent tokens,
    `window` entries in all, itself included. Held between steps: what the next token sees, less itself."""
    between = []
    for t in range(T):
        seen_by_t = list(range(t + 1))
        if len(seen_by_t) > window:
            seen_by_t = seen_by_t[:sinks] + seen_by_t[len(seen_by_t) - (window - sinks) :]
        nxt = list(range(t + 2))
        if len(nxt) > window:
            nxt = nxt[:sinks] + nxt[len(nxt) - (window - sinks) :]
        between.append([p for p in nxt if p != t + 1])
    return between


def hf_sink_cache(window: int, sinks: int) -> list[list[int]]:
    """transformers' SinkCache.update for one new token: grow while `len + 1 < window`, else keep the
    sinks and the last `window - sinks - 1` cached entries, then append. Held between steps: the
    next update's kept entries."""
    cache: list[int] = []
    between = []
    for t in range(T + 1):
        if t:
            if len(cache) + 1 < window:
                between.append(list(cache))
            else:
                between.append(cache[:sinks] + cache[len(cache) - (window - sinks - 1) :])
        if t < T:
            if len(cache) + 1 < window:
                cache = cache + [t]
            else:
                cache = cache[:sinks] + cache[len(cache) - (window - sinks - 1) :] + [t]
    return between


def vllm_sliding(window: int) -> list[list[int]]:
    """vLLM's sliding window: the token at p attends to keys in (p - window, p]."""
    return [[k for k in range(t + 1) if k > t + 1 - window] for t in range(T)]


def truncate_tail(k: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens=k: the last k tokens."""
    return [list(range(max(0, t + 1 - k), t + 1)) for t in range(T)]


def truncate_head(k: int) -> list[list[int]]:
    """SGLang's auto-truncate: the first k tokens."""
    return [list(range(min(t + 1, k))) for t in range(T)]


CASES = [
    ("llamacpp:keep=0,bos=0", "cache", lambda: llama_server(CTX, 0, False)),
    ("llamacpp:keep=0,bos=1", "cache", lambda: llama_server(CTX, 0, True)),
    ("llamacpp:keep=2,bos=1", "cache", lambda: llama_server(CTX, 2, True)),
    ("llamacpp:keep=4,bos=0", "cache", lambda: llama_server(CTX, 4, False)),
    ("ollama:bos=0", "cache", lambda: llama_server(CTX, 4, False)),
    ("trtllm:sink=0", "original", lambda: window_with_sinks(CTX, 0)),
    ("trtllm:sink=3,streamingllm=1", "cache", lambda: window_with_sinks(CTX, 3)),
    ("mlc", "cache", lambda: window_with_sinks(CTX, 4)),
    ("hf-sinkcache:sinks=4", "cache", lambda: hf_sink_cache(CTX, 4)),
    ("hf-sinkcache:sinks=1", "cache", lambda: hf_sink_cache(CTX, 1)),
    ("vllm-swa", "original", lambda: vllm_sliding(CTX)),
    ("vllm-truncate", "cache", lambda: truncate_tail(CTX)),
    ("sglang-truncate", "original", lambda: truncate_head(CTX)),
]


def held_after_each_step(spec: str, positions: str, chunks: list[int]) -> list[list[int]]:
    """Feed TOKENS in `chunks` through a cache running `spec` at budget CTX (per-token replay inside
    chunks); after each forward, the stream positions layer 0 holds (every layer must agree)."""
    cache = EvictingCache(MODEL, [spec], budget=CTX, positions=positions, per_token=True)
    out, seen = [], 0
    with torch.inference_mode():
        for q in chunks:
            body(MODEL, TOKENS[None, seen : seen + q], cache)
            seen += q
            layers = [layer.kept_positions()[0, 0].tolist() for layer in cache.layers]
            assert all(held == layers[0] for held in layers), layers
            for head in cache.layers[0].kept_positions()[0]:
                assert head.tolist() == layers[0]
            out.append(layers[0])
    return out


@pytest.mark.parametrize("spec,positions,engine", CASES, ids=[c[0] for c in CASES])
def test_token_by_token_holds_what_the_engine_holds(spec, positions, engine):
    expected = engine()
    assert held_after_each_step(spec, positions, [1] * T) == expected


@pytest.mark.parametrize("spec,positions,engine", CASES, ids=[c[0] for c in CASES])
def test_chunks_hold_what_the_engine_holds(spec, positions, engine):
    expected = engine()
    chunks = [5, 1, 6, 3, 5]
    ends = [sum(chunks[: i + 1]) - 1 for i in range(len(chunks))]
    assert held_after_each_step(spec, positions, chunks) == [expected[e] for e in ends]


def test_llama_server_shift_points_by_hand():
    """The simulation itself, against a trace worked by hand: n_ctx 8, keep 0, no BOS. Before token 7
    the cache holds 0..6 (7 cells, 7 + 1 >= 8): (7 - 0) // 2 = 3 go (0, 1, 2). Tokens 7, 8, 9 fill it
    again (3..9), so before token 10 another 3 go. With keep 4: n_keep 4, 7 - 4 = 3 left, 1 goes."""
    trace = llama_server(8, 0, False)
    assert trace[5] == [0, 1, 2, 3, 4, 5]
    assert trace[6] == [3, 4, 5, 6]
    assert trace[8] == [3, 4, 5, 6, 7, 8]
    assert trace[9] == [6, 7, 8, 9]
    kept4 = llama_server(8, 4, False)
    assert kept4[6] == [0, 1, 2, 3, 5, 6]
    assert kept4[7] == [0, 1, 2, 3, 6, 7]


def test_preset_positions_are_the_engines():
    for spec, positions, _ in CASES:
        other = "original" if positions == "cache" else "cache"
        with pytest.raises(KvevictError, match=f"--positions {positions}"):
            check_policy(spec, CTX, other)
        assert parse_policy(spec).position_mode == positions


# --- page-granular eviction --------------------------------------------------------------


def paged_window(budget: int, page: int, sinks: int) -> list[list[int]]:
    """A paged cache that frees whole pages of `page` tokens, oldest first: once more than `budget`
    are held, the fewest whole pages that bring it back within the budget go; the page holding the
    sinks and the partly filled last page never do."""
    cells: list[int] = []
    between = []
    for t in range(T):
        cells.append(t)
        if len(cells) > budget:
            need = -(-(len(cells) - budget) // page)
            protected = {p // page for p in range(sinks)} | ({t // page} if (t + 1) % page else set())
            pages = sorted({c // page for c in cells} - protected)
            gone = set(pages[:need])
            cells = [c for c in cells if c // page not in gone]
        between.append(list(cells))
    return between


PAGED_CASES = [
    ("window:page=4", lambda: paged_window(10, 4, 0)),
    ("window:page=3,pagescore=max", lambda: paged_window(10, 3, 0)),
    ("sink2+window:page=4", lambda: paged_window(14, 4, 2)),
    ("window:page=1", lambda: paged_window(10, 1, 0)),
]


@pytest.mark.parametrize("spec,engine", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_pages_go_whole(spec, engine, positions):
    budget = 14 if spec.startswith("sink2") else 10
    expected = engine()
    cache = EvictingCache(MODEL, [spec], budget=budget, positions=positions, per_token=True)
    held, seen = [], 0
    with torch.inference_mode():
        for q in [4, 1, 1, 7, 1, 6]:
            body(MODEL, TOKENS[None, seen : seen + q], cache)
            seen += q
            held.append(cache.layers[0].kept_positions()[0, 0].tolist())
    ends = [3, 4, 5, 12, 13, 19]
    assert held == [expected[e] for e in ends]


@dataclass(eq=False)
class _NewestOut(Policy):
    """The newest entry scores lowest (SGLang's head-keeping, as a plain policy that pages may wrap)."""

    def spec(self) -> str:
        return "newestout"

    def scores(self, view: SlotView) -> torch.Tensor:
        return -view.positions.double()


def paged_newest_out(budget: int, page: int) -> list[list[int]]:
    """Whole pages, newest full page first; the last page is spared only while partly filled."""
    cells: list[int] = []
    between = []
    for t in range(T):
        cells.append(t)
        if len(cells) > budget:
            need = -(-(len(cells) - budget) // page)
            partial = {t // page} if (t + 1) % page else set()
            pages = sorted({c // page for c in cells} - partial, reverse=True)
            gone = set(pages[:need])
            cells = [c for c in cells if c // page not in gone]
        between.append(list(cells))
    return between


def test_a_full_last_page_may_go_a_partial_one_may_not():
    expected = paged_newest_out(11, 4)
    # hand-checked: 12 held after token 11 and its page (8..11) is full, so it is the one to go
    assert expected[11] == list(range(8)) and expected[12] == [*range(8), 12]
    register("newestout", _NewestOut)
    try:
        cache = EvictingCache(MODEL, ["newestout:page=4"], budget=11, per_token=True)
        held = []
        with torch.inference_mode():
            for t in range(T):
                body(MODEL, TOKENS[None, t : t + 1], cache)
                held.append(cache.layers[0].kept_positions()[0, 0].tolist())
    finally:
        REGISTRY.pop("newestout")
    assert held == expected


# --- hybrid models: llama.cpp's n_ctx holds the sliding-window layers too ---------------------


HYBRID_CTX = 10  # up to 9 entries held, beyond the sliding window of 7: the band must hide the oldest


def hybrid_stream(spec: str, chunk: int) -> tuple[torch.Tensor, list[list[list[int]]]]:
    """NLL `[T-1]` and, after each forward, every layer's held positions on the tiny Gemma 3 (window 7)."""
    from architectures import Arch
    from kvevict.eval.forward import log_probs
    from kvevict.eval.streaming import boundaries

    model = Arch("gemma3", ("cache",)).build(seed=43)
    tokens = TOKENS % 101
    cache = EvictingCache(model, [spec], budget=HYBRID_CTX, positions="cache", per_token=True)
    nll = torch.zeros(T - 1)
    held = []
    with torch.inference_mode():
        for start, stop in boundaries(T, 1, chunk):
            hidden = body(model, tokens[None, start:stop], cache)
            lp = log_probs(model, hidden)[0, : T - 1 - start]
            targets = tokens[start + 1 : stop + 1]
            nll[start : start + targets.numel()] = -lp.gather(-1, targets[:, None])[:, 0]
            held.append([layer.kept_positions()[0, 0].tolist() for layer in cache.layers])
    return nll, held


def test_llama_cpp_bounds_the_sliding_layers_of_a_hybrid_model():
    """Every layer, sliding ones included, holds llama-server's cells; the sliding layers still see only
    their window (7 < 9 held) over the renumbered positions, the same in chunks as token by token."""
    expected = llama_server(HYBRID_CTX, 0, True)
    ref_nll, held = hybrid_stream("llamacpp:keep=0,bos=1", 1)
    for t, layers in enumerate(held):
        assert all(layer == expected[t] for layer in layers), (t, layers)
    nll, _ = hybrid_stream("llamacpp:keep=0,bos=1", 6)
    assert (nll - ref_nll).abs().max() < 1e-4


def test_an_own_schedule_cannot_share_a_cache():
    with pytest.raises(KvevictError, match="evicts on its own schedule and cannot share a batch with window"):
        EvictingCache(MODEL, ["llamacpp", "window"], budget=CTX, positions="cache")
    EvictingCache(MODEL, ["llamacpp", "llamacpp"], budget=CTX, positions="cache")  # copies of itself share


def test_compare_runs_a_preset_in_its_own_batch(tiny_dir):
    """`kvevict compare` with a preset beside other policies: each own-schedule policy runs in a batch of
    its own, against the same full cache, and gives what `kvevict ppl` gives for it alone."""
    import json

    from support import cli

    common = ["--model", str(tiny_dir), "--tokens", "48", "--budget", "12", "--positions", "cache"]
    out = cli("compare", *common, "--policies", "llamacpp:keep=2,window:page=3", "--json")
    assert out.exit_code == 0, out.output
    rows = {r["policy"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["rows"]}
    alone = json.loads(cli("ppl", *common, "--policy", "llamacpp:keep=2", "--json").stdout.strip().splitlines()[-1])
    preset = rows["llamacpp:keep=2,bos=0"]
    assert abs(preset["ppl"] - alone["ppl"]) < 1e-4 * alone["ppl"]
    assert preset["mean_kept"] < preset["max_kept"] <= 12
    assert {"full", "window:page=3"} <= set(rows)


# --- the memory a burst-evicting engine actually holds: `mean_kept` from `kvevict ab` to the report ----


def llama_server_held(n_ctx: int, keep: int, steps: int) -> list[int]:
    """Cells llama-server holds after each token of a stream, the shift included (no BOS), counted
    one token at a time: append the token, then shift when `held + 1 >= n_ctx`."""
    held, out = 0, []
    for _ in range(steps):
        held += 1
        if held + 1 >= n_ctx:
            left = held - keep
            held -= max(0, min(left // 2, left - 1))
        out.append(held)
    return out


def header_cells(table: str) -> list[str]:
    """The column headings of the first box-drawn table in `table`, a heading wrapped over lines rejoined."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┃"))
    rows = [line.strip("┃").split("┃") for line in lines[start:] if line.startswith("┃")][:4]
    rows = rows[: next((i for i, line in enumerate(lines[start:]) if not line.startswith("┃")), len(rows))]
    return [" ".join(" ".join(cell.split()) for cell in column).strip() for column in zip(*rows)]


def test_ab_records_and_reports_what_a_burst_preset_holds_on_average(tiny_dir, tmp_path):
    """`kvevict ab` with `llamacpp:keep=2` at n_ctx 12 over 40 tokens. Worked by hand: the cache grows to
    10 (tokens 0-9: 1..10, sum 55); token 10 makes 11, and 11 + 1 >= 12 shifts out (11 - 2) // 2 = 4,
    leaving 7; from then on it holds 8, 9, 10, 7 (one shift every 4 tokens): tokens 11-38 are 7 such
    cycles (7 x 34 = 238) and token 39 holds 8. Mean 308 / 40 = 7.7 entries, against `kept` (the most)
    11 - 1 = 10 between tokens, and 10.35 for a window of 12 (1..12, then 12: 414 / 40)."""
    import json

    from support import cli

    assert sum(llama_server_held(12, 2, 40)) == 308  # the loop above agrees with the hand count
    run = tmp_path / "runs" / "burst"
    out = cli("ab", "--model", str(tiny_dir), "--tokens", "40", "--budgets", "12", "--positions", "cache",
              "--policies", "llamacpp:keep=2,window", "--oracle-stride", "0", "--out", str(tmp_path / "runs"),
              "--name", "burst", env={"COLUMNS": "120"})  # room for every column (narrower drops some)
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    rows = {r["policy"]: r for r in lines if r.get("kind") in ("policy", "full")}
    preset, window, full = rows["llamacpp:keep=2,bos=0"], rows["window"], rows["full"]
    assert preset["mean_kept"] == pytest.approx(7.7)
    assert window["mean_kept"] == pytest.approx(10.35)
    assert full["mean_kept"] == pytest.approx(20.5)  # the full cache holds 1, 2, ... 40
    # every table shows it, in one column: the terminal summary of `ab`, the Markdown and the HTML report
    assert "mean kept" in header_cells(out.stdout)
    markdown = cli("report", str(run), "--markdown")
    assert markdown.exit_code == 0, markdown.output
    table = [line for line in markdown.stdout.splitlines() if line.startswith("| ")]
    headers = [h.strip() for h in table[0].strip("|").split("|")]
    cells = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in table[1:])}
    column = headers.index("mean kept")
    assert cells["llamacpp:keep=2,bos=0"][column] == "8" and cells["window"][column] == "10"
    assert "mean kept" in (run / "report.html").read_text()


def test_needle_runs_a_preset_in_its_engines_position_mode(tiny_dir):
    """`kvevict needle --positions cache` with `llamacpp` runs (its budget check is made in the mode the
    cells run in, not in the default `original`), and `--positions original` is refused in one line that
    names the fix."""
    import json

    from support import cli

    common = ["needle", "--model", str(tiny_dir), "--lengths", "120", "--depths", "0.5", "--trials", "1",
              "--policies", "llamacpp:keep=2", "--budgets", "32"]
    ran = cli(*common, "--positions", "cache", "--json")
    assert ran.exit_code == 0, ran.output
    cells = json.loads(ran.stdout.strip().splitlines()[-1])["cells"]
    assert [c["policy"] for c in cells] == ["llamacpp:keep=2,bos=0"] and cells[0]["trials"] == 1
    refused = cli(*common, "--positions", "original")
    assert refused.exit_code == 2 and "--positions cache" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_llamacpp_keeps_bos_when_the_models_tokenizer_adds_it():
    """llama-server's `n_keep += add_bos_token`: `llamacpp:keep=0` with BOS read from a tokenizer that adds
    it holds what the simulation holds with add_bos (token 0 stays), and without BOS what it holds without;
    `bos=` written out overrides the tokenizer."""
    from kvevict.data import stream_start
    from kvevict.loading import load_tokenizer
    from kvevict.policies.engine_defaults import with_stream_start

    tokenizer = load_tokenizer("smollm2-135m")
    assert stream_start(tokenizer) == []
    tokenizer.add_bos_token = True  # as Gemma 3's vocabulary does
    adds = bool(stream_start(tokenizer))
    assert adds
    (spec,) = with_stream_start(["llamacpp:keep=0"], adds)
    assert held_after_each_step(spec, "cache", [1] * T) == llama_server(CTX, 0, True)
    (kept,) = with_stream_start(["llamacpp:keep=0,bos=0"], adds)
    assert held_after_each_step(kept, "cache", [1] * T) == llama_server(CTX, 0, False)
    assert with_stream_start(["ollama", "window"], False) == ["ollama:keep=4,bos=0", "window"]
    with pytest.raises(KvevictError, match="reads add-BOS from the model's tokenizer"):
        held_after_each_step("llamacpp:keep=0", "cache", [1] * T)
