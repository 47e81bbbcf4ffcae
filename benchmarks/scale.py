"""Cost and memory at the attention shapes teams run: streams to 128K tokens, compression, decode steps.

Random-weight models at the attention shapes of Llama-3.1-8B, Qwen3-8B and Gemma-3-12B (`shapes.py`:
the real hidden size, heads, head dim and rotary; Gemma 3's sliding window of 1,024 and a sliding and a
global layer; one or two layers, an MLP of 1,024 and a vocabulary of 1,024), random ids. Three parts:

* **stream**: `kvevict.eval.streaming.compare(model, ids, [policy], budget, reference=False)` (no full
  row) for every policy family. One stream of the longest length per (model, policy); its first 8K, 32K
  tokens are the streams of those lengths (the same forwards), so each length's row is read at that
  point of it: seconds per 1K tokens over the stretch since the previous length (since the prefill for
  the first), and the peak memory up to there. Beside it, taking turns forward by forward in the same
  process, the **SDPA baseline**: the same model with transformers' SDPA attention and a cache of the
  latest `budget` tokens per full-attention layer (the model's own window on a sliding one), reading the
  same tokens in the same forwards and scoring them the same way (LM head, log-softmax, NLL): what a
  bounded stream costs with nothing chosen. `ratio` is kvevict's seconds over the baseline's. The
  storage forms that count a residual or key blocks at a forward's end read their stream one token per
  forward, as decode (`EvictingCache.chunk_exact`), so they stop at `--tbt-max`.
* **compress**: `kvevict.compress(model, ids, policy, budget, chunk=prefill_chunk)`: the context read
  in chunks into the full cache, then scored and compressed (`eval/compress.prefill`), for SnapKV,
  Expected Attention, KVzip (its repeat forwards too) and LagKV; and SnapKV in one forward at the
  shortest length, for its peak beside the chunked one. A prefill's attention is quadratic in the
  context, so its seconds per 1K grow with the length by construction.
* **decode**: `decode_overhead.py`'s steps (every arm against DynamicCache, taking turns step by step) on
  the embedded SmolLM2 and the Llama-3.1-8B shape, in the same run.

Memory: the peak resident set (`VmHWM`, reset at the arm's start; `kvevict.ab.meter`) above the resident
set before the arm's stream, on CUDA `torch.cuda.max_memory_allocated` (torch's allocator) beside it,
against the bound `KV + workspace + CONSTANT_MB`: KV the cache's own bytes (`EvictingCache.memory`: a
stream's cache at its budget plus the baseline's latest tokens; a compression's full cache of the context,
which the prefill holds before it evicts), the workspace what one forward holds (`workspace_bytes`), and a
constant for the allocator and the interpreter. With `--tracemalloc` the Python heap's peak (tracemalloc;
tensors are not in it) is added, at the cost of slower Python. Each arm runs in a fresh process
(`--isolate arm`): an allocator keeps what one arm freed resident, which would hide the next arm's peak.

    .venv/bin/python benchmarks/scale.py                     # smoke sizes: a minute or two
    .venv/bin/python benchmarks/scale.py --full --json scale.json   # 8K/32K/128K: see docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("stream", "compress", "decode")
STREAM_POLICIES = ["window", "sink4+window", "h2o", "tova", "snapkv", "knorm", "keydiff", "pyramidkv", "adakv:snapkv",
                   "q4:group=64,residual=128+window", "q4:group=64,residual=128,keys=channel+window", "fp8+window"]
COMPRESS_POLICIES = ["snapkv", "expected-attention", "kvzip", "lagkv"]
DECODE_MODELS = ["smollm2-135m", "llama-3.1-8b"]
#: sizes per preset; an option given on the command line wins
PRESETS = {
    "smoke": dict(lengths="1024,1536", budget=512, chunk=256, compress_lengths="1024", compress_long="",
                  prefill_chunk=256, tbt_max=768, decode_budget=256, decode_steps=8, decode_rounds=1),
    # a CPU's prefill is quadratic in the context: at 128K only SnapKV (the chunked prefill's memory), 32K for all
    "full": dict(lengths="8192,32768,131072", budget=4096, chunk=256, compress_lengths="32768,131072",
                 compress_long="snapkv", prefill_chunk=4096, tbt_max=16384, decode_budget=4096, decode_steps=48,
                 decode_rounds=2),
}
#: MiB above the stated terms: the allocator's slack, the interpreter's and the libraries' own growth
CONSTANT_MB = 256
#: a chunk's activations: this many `[q, hidden]` float tensors alive at once (residual, norms, q/k/v, MLP)
ACTIVATIONS = 16
MB = 2**20


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="full sizes: 8K/32K/128K streams, 32K/128K compression")
    parser.add_argument("--parts", default="stream,compress,decode", help=f"comma-separated of {', '.join(PARTS)}")
    parser.add_argument("--models", default="llama-3.1-8b,qwen3-8b,gemma-3-12b", help="attention shapes (shapes.py)")
    parser.add_argument("--scale", type=int, default=1, help="divide the hidden size and heads (a smoke run in CI)")
    parser.add_argument("--layers", type=int, default=None, help="layers per model (default: 1; Gemma 3: 2)")
    parser.add_argument("--policies", default=";".join(STREAM_POLICIES), help="stream policies, ';'-separated")
    parser.add_argument("--compress-policies", default=";".join(COMPRESS_POLICIES), help="';'-separated")
    parser.add_argument("--decode-models", default=",".join(DECODE_MODELS), help="embedded models and shapes")
    parser.add_argument("--lengths", help="stream lengths in tokens, comma-separated (one stream of the longest)")
    parser.add_argument("--budget", type=int, help="entries per layer and KV head (stream and compression)")
    parser.add_argument("--chunk", type=int, help="stream tokens per forward after the prefill")
    parser.add_argument("--compress-lengths", help="context lengths compressed, comma-separated")
    parser.add_argument("--compress-long", help="';'-separated policies compressed beyond the shortest length "
                                                "(empty: every --compress-policies one)")
    parser.add_argument("--prefill-chunk", type=int, help="tokens per forward of a compression's prefill")
    parser.add_argument("--tbt-max", type=int, help="longest stream read token by token (residual storage forms)")
    parser.add_argument("--decode-budget", type=int)
    parser.add_argument("--decode-steps", type=int)
    parser.add_argument("--decode-rounds", type=int)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default=None, help="float32 (default on the CPU) or bfloat16 (default on CUDA)")
    parser.add_argument("--isolate", default="arm", choices=["arm", "none"],
                        help="arm: each arm in a fresh process (its own peak); none: all in this one (a smoke test)")
    parser.add_argument("--tracemalloc", action="store_true", help="also the Python heap's peak (slows Python)")
    parser.add_argument("--json", help="append every arm's rows to this file as it finishes, one JSON object per "
                        "line; the arms it already holds are not run again")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the arms a child process runs (JSON)
    args = parser.parse_args(argv)
    for key, value in PRESETS["full" if args.full else "smoke"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    shortest = min(int(n) for n in args.lengths.split(","))
    if "stream" in args.parts.split(",") and min(shortest, args.tbt_max) <= args.budget:
        parser.error(f"every stream length and --tbt-max must exceed the budget ({args.budget}): a stream's cost is "
                     f"read after its prefill of the budget's tokens")
    return args


def plan(args: argparse.Namespace) -> list[dict]:
    """Every arm of the run, in the order they run and print."""
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"error: --parts takes {', '.join(PARTS)}, got {', '.join(unknown)}")
    arms = []
    for model in args.models.split(","):
        if "stream" in parts:
            arms += [{"part": "stream", "model": model, "policy": p} for p in args.policies.split(";") if p]
        if "compress" in parts:
            lengths = sorted(int(n) for n in args.compress_lengths.split(","))
            policies = [p for p in args.compress_policies.split(";") if p]
            longer = [p for p in args.compress_long.split(";") if p] or policies
            arms += [{"part": "compress", "model": model, "policy": "snapkv", "length": lengths[0], "one": True}]
            arms += [{"part": "compress", "model": model, "policy": p, "length": n}
                     for n in lengths for p in (policies if n == lengths[0] else longer)]
    if "decode" in parts:
        arms += [{"part": "decode", "model": m} for m in args.decode_models.split(",")]
    return arms


# --- measuring, in the process that runs an arm ---------------------------------------------------------
def status_mb() -> tuple[float, float] | None:
    """(peak resident set since the last reset, resident set) in MiB, from `/proc/self/status`."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    hwm, rss = re.search(r"VmHWM:\s+(\d+)", text), re.search(r"VmRSS:\s+(\d+)", text)
    return (int(hwm.group(1)) / 1024, int(rss.group(1)) / 1024) if hwm and rss else None


class Memory:
    """The arm's memory: the resident set before it, the peaks at each look (`peak`), the device's."""

    def __init__(self, device, traced: bool) -> None:
        import torch

        from kvevict.ab.meter import measure

        self.cuda = torch.device(device).type == "cuda"
        self.device, self.traced = device, traced
        self._meter = measure(device)  # resets the resident set's peak (proved, else sampled) and the device's
        self.cost = self._meter.__enter__()
        self.start = (status_mb() or (0.0, 0.0))[1]
        if traced:
            import tracemalloc

            tracemalloc.start()

    def peak(self) -> dict:
        """The peaks so far: resident set above the start, torch's CUDA allocator, the Python heap."""
        import torch

        out = {"rss_start_mb": self.start, "peak_rss_mb": max(0.0, (status_mb() or (self.start, 0.0))[0] - self.start)}
        if self.cuda:
            out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
        if self.traced:
            import tracemalloc

            out["python_peak_mb"] = tracemalloc.get_traced_memory()[1] / MB
        return out

    def close(self) -> dict:
        """The arm's peaks (the meter's resident-set peak where it is proved), and stop measuring."""
        found = self.peak()
        if self.traced:
            import tracemalloc

            tracemalloc.stop()
        self._meter.__exit__(None, None, None)
        found["peak_rss_mb"] = max(found["peak_rss_mb"], self.cost.peak_mb - self.start)
        found["peak_scope"] = self.cost.peak_mb_scope
        return found


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


#: a block of attention statistics (`statistics/probabilities.BLOCK_ELEMENTS` float32 logits), its mask, probabilities
STATISTICS_BLOCK = 3 * 2**24 * 4
#: a prefill's causal mask, float32, one block of queries at a time: the default workspace
MASK_BLOCK = 2**24 * 4


def workspace_bytes(model, q: int, keys: int, replayed: bool) -> int:
    """What one forward of `q` tokens over `keys` entries holds besides the cache, counted at 4 bytes a number
    whatever the dtype: its activations (`ACTIVATIONS` `[q, hidden]` tensors); where its attention is replayed
    token by token (a stream, `replayed`) the chunk's logits, probabilities and mask per query head, else (a
    prefill) its causal mask, float32 `[q, keys + q]` at most one workspace of it (`causal_sdpa` makes it in
    blocks of queries), and a block of statistics."""
    text = model.config
    heads, hidden = text.num_attention_heads, text.hidden_size
    attention = 3 * q * heads * (keys + q) * 4 if replayed else min(q * (keys + q) * 4, MASK_BLOCK) + STATISTICS_BLOCK
    return attention + ACTIVATIONS * q * hidden * 4


class Baseline:
    """The same model with transformers' SDPA and a cache of the latest `budget` tokens of each full-attention
    layer (Gemma 3's sliding layers: the model's window), fed the same forwards and scored the same way."""

    def __init__(self, model, budget: int) -> None:
        from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

        class LatestTokens(DynamicSlidingWindowLayer):
            """A full-attention layer's latest `budget` tokens: a window's storage and mask offsets, under the
            model's causal mask (a sliding one would drop what the window keeps)."""

            is_sliding = False

        self.model = model
        text = model.config.get_text_config(decoder=True)
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        self.cache = Cache(layers=[DynamicSlidingWindowLayer(text.sliding_window) if kind == "sliding_attention"
                                   else LatestTokens(budget + 1) for kind in kinds])

    def feed(self, ids, targets) -> float:
        """Read `ids` `[q]`, score `targets` `[q']`; the seconds it took."""
        import torch

        from kvevict.eval.forward import body, log_probs

        self.model.set_attn_implementation("sdpa")
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                hidden = body(self.model, ids[None], self.cache)[0, : targets.numel()]
                if targets.numel():  # the stream's last token predicts nothing
                    log_probs(self.model, hidden).gather(-1, targets[:, None])
            sync(ids.device)
            return time.perf_counter() - t0
        finally:
            self.model.set_attn_implementation("kvevict")

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values)
                   if t is not None)


def stream_arm(args, model, arm: dict) -> list[dict]:
    """One policy's stream, read by `compare`; the SDPA baseline takes its turn after each forward."""
    from shapes import random_ids

    from kvevict.eval.chunks import prefill_piece
    from kvevict.eval.streaming import compare
    from kvevict.policies import parse_policy

    storage = parse_policy(arm["policy"]).kv_storage
    by_token = storage is not None and not storage.chunk_exact
    lengths = sorted(int(n) for n in args.lengths.split(","))
    if by_token:
        lengths = [n for n in lengths if n <= args.tbt_max] or [args.tbt_max]
    ids = random_ids(max(lengths)).to(args.device)
    baseline = Baseline(model, args.budget)
    rows: list[dict] = []
    at = {"read": 0, "since": None, "own": 0.0, "base": 0.0, "from": 0, "mark": 0}
    memory = Memory(args.device, args.tracemalloc)

    def turn(stop: int) -> None:
        sync(args.device)
        now = time.perf_counter()
        own = now - at["since"]
        base = baseline.feed(ids[at["read"] : stop], ids[at["read"] + 1 : stop + 1])
        if stop <= args.budget:  # the prefill's pieces: not a stretch of the stream's steady cost
            at["from"] = stop
        else:
            at["own"] += own
            at["base"] += base
        at["read"] = stop
        if at["mark"] < len(lengths) and stop >= lengths[at["mark"]]:
            tokens = stop - at["from"]
            rows.append({"tokens": lengths[at["mark"]], "s_per_1k": 1000 * at["own"] / tokens,
                         "sdpa_s_per_1k": 1000 * at["base"] / tokens, "ratio": at["own"] / at["base"],
                         "read": "token by token" if by_token else f"chunks of {args.chunk}",
                         "prefill": f"pieces of {prefill_piece(args.chunk)}", **memory.peak()})
            at.update(own=0.0, base=0.0, **{"from": stop, "mark": at["mark"] + 1})
        at["since"] = time.perf_counter()

    at["since"] = time.perf_counter()
    results, _ = compare(model, ids, [arm["policy"]], args.budget, reference=False, progress=False, on_step=turn,
                         chunk=args.chunk)
    found = memory.close()
    kv = results[0].memory["kv_bytes"] + baseline.kv_bytes()
    bound = kv + workspace_bytes(model, args.chunk, args.budget, replayed=True) + CONSTANT_MB * MB
    for row in rows:
        row.update(kv_mb=kv / MB, bound_mb=bound / MB)
    rows[-1].update({k: v for k, v in found.items() if k != "rss_start_mb"})
    return rows


def compress_arm(args, model, arm: dict) -> list[dict]:
    """One compression of a `length`-token context: the prefill in chunks (or one forward), scoring, eviction."""
    import torch
    from shapes import random_ids

    from kvevict.eval.compress import compress
    from kvevict.eval.reconstruction import RepeatFraming
    from kvevict.policies import parse_policy

    length, chunk = arm["length"], None if arm.get("one") else args.prefill_chunk
    ids = random_ids(length).to(args.device)
    # a random model has no chat template: KVzip's repeat request as a few fixed ids (as tests/test_kvzip.py)
    framing = RepeatFraming(6, torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11]))
    tokenizer = framing if parse_policy(arm["policy"]).reconstructs else None
    memory = Memory(args.device, args.tracemalloc)
    t0 = time.perf_counter()
    state = compress(model, ids, arm["policy"], args.budget, tokenizer=tokenizer, chunk=chunk)
    sync(args.device)
    seconds = time.perf_counter() - t0
    found = memory.close()
    kv = state.cache.memory().full_kv_bytes
    bound = kv + workspace_bytes(model, chunk or length, length, replayed=False) + CONSTANT_MB * MB
    return [{"tokens": length, "s_per_1k": 1000 * seconds / length, "seconds": seconds,
             "read": "one forward" if chunk is None else f"chunks of {chunk}", "kv_mb": kv / MB, "bound_mb": bound / MB,
             **{k: v for k, v in found.items() if k != "rss_start_mb"}}]


def decode_arm(args, arm: dict) -> list[dict]:
    """`decode_overhead.py`'s steps on one model: every arm against DynamicCache, taking turns."""
    import torch
    from decode_overhead import SHAPE_ARMS, load, median, step_times

    dtype = getattr(torch, args.dtype)
    model, tokens, targets = load(arm["model"], args.device, dtype, args.decode_budget + args.decode_steps + 1)
    arms = ["dynamic", *SHAPE_ARMS]
    times = step_times(model, tokens, arms, args.decode_budget, args.decode_steps, args.decode_rounds)["times"]
    base = median(times["dynamic"])
    return [{"policy": a, "tokens": args.decode_budget, "ms_per_step": 1000 * median(times[a]),
             "ratio": median(times[a]) / base, "target": targets.get(a)} for a in arms]


def run_arms(args, arms: list[dict]) -> list[dict]:
    """Run `arms` in this process (models built once per shape); every row tagged with its arm."""
    import torch
    from shapes import build, model_bytes

    torch.manual_seed(0)
    rows, models = [], {}
    for arm in arms:
        try:
            if arm["part"] == "decode":
                found = decode_arm(args, arm)
            else:
                if arm["model"] not in models:
                    models.clear()
                    models[arm["model"]] = build(arm["model"], args.device, getattr(torch, args.dtype), args.layers,
                                                 args.scale)
                model = models[arm["model"]]
                found = (stream_arm if arm["part"] == "stream" else compress_arm)(args, model, arm)
                for row in found:
                    row["model_mb"] = model_bytes(model) / MB
        except Exception as error:  # one arm's failure is its row; the others still run
            found = [{"failed": f"{type(error).__name__}: {error}"[:200]}]
        for row in found:
            rows.append({**{k: v for k, v in arm.items() if k != "one"}, **row,
                         "policy": row.get("policy", arm.get("policy")) + (" (one forward)" if arm.get("one") else ""),
                         "device": args.device, "dtype": args.dtype})
    return rows


# --- the parent: arms in processes, one table --------------------------------------------------------------
def child_rows(args, arms: list[dict], argv: list[str]) -> list[dict]:
    """Run `arms` in a fresh process; its rows (an arm that failed gives a row saying so)."""
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", json.dumps(arms)], capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return [{**arm, "failed": reason} for arm in arms]
    return [json.loads(line) for line in lines]


COLUMNS = [("part", "{}", 9), ("model", "{}", 14), ("policy", "{}", 44), ("tokens", "{:,}", 9),
           ("s_per_1k", "{:.3f}", 9), ("sdpa_s_per_1k", "{:.3f}", 9), ("ratio", "{:.3f}", 7),
           ("ms_per_step", "{:.1f}", 8), ("target", "<={:.2f}", 7), ("peak_rss_mb", "{:.0f}", 8),
           ("cuda_peak_mb", "{:.0f}", 8), ("bound_mb", "{:.0f}", 8), ("read", "{}", 16)]
HEADERS = {"s_per_1k": "s/1K", "sdpa_s_per_1k": "SDPA s/1K", "ms_per_step": "ms/step", "peak_rss_mb": "peak MB",
           "cuda_peak_mb": "CUDA MB", "bound_mb": "bound MB"}


def line(row: dict) -> str:
    if "failed" in row:
        return f"{row['part']:<9} {row['model']:<14} {row.get('policy', ''):<44} FAILED: {row['failed']}"
    cells = []
    for key, form, width in COLUMNS:
        value = row.get(key)
        cells.append(f"{'' if value is None else form.format(value):>{width}}" if key not in ("part", "model", "policy",
                     "read") else f"{'' if value is None else value:<{width}}")
    return " ".join(cells)


def flat(rows: list[dict]) -> list[str]:
    """Per (model, policy) stream: the cost at the longest length over the first (target: within 10%)."""
    out, streams = [], {}
    for row in rows:
        if row.get("part") == "stream" and "failed" not in row:
            streams.setdefault((row["model"], row["policy"]), []).append(row)
    for (model, policy), found in streams.items():
        if len(found) > 1:
            growth = found[-1]["s_per_1k"] / found[0]["s_per_1k"]
            out.append(f"{model} {policy}: s/1K {found[0]['tokens']:,} -> {found[-1]['tokens']:,} tokens x{growth:.2f}"
                       f" ({'within' if abs(growth - 1) <= 0.10 else 'outside'} 10%)")
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    if args.child is not None:  # a child: run the arms, one JSON row per line
        for row in run_arms(args, json.loads(args.child)):
            print(json.dumps(row), flush=True)
        return
    arms = plan(args)
    print(f"scale: {args.models} (hidden and heads / {args.scale}), {args.device} {args.dtype}, budget "
          f"{args.budget}, stream {args.lengths} in chunks of {args.chunk} (token by token to {args.tbt_max}), "
          f"compress {args.compress_lengths} in chunks of {args.prefill_chunk}; peak MB above the arm's start "
          f"(bound: KV + workspace + {CONSTANT_MB} MB)", flush=True)
    print(" ".join(f"{HEADERS.get(k, k):>{w}}" if k not in ("part", "model", "policy", "read") else
                   f"{HEADERS.get(k, k):<{w}}" for k, _, w in COLUMNS), flush=True)
    rows = recorded(args.json, arms)
    for row in rows:
        print(line(row), flush=True)
    done = {arm_key(row) for row in rows}
    todo = [arm for arm in arms if arm_key(arm) not in done]
    batches = [[arm] for arm in todo] if args.isolate == "arm" else [todo] if todo else []
    for batch in batches:
        found = child_rows(args, batch, argv) if args.isolate == "arm" else run_arms(args, batch)
        for row in found:
            print(line(row), flush=True)
        rows += found
        if args.json:  # each finished arm appended at once: an interrupted run keeps it, and a rerun resumes
            with open(args.json, "a") as out:
                out.write("".join(json.dumps(row) + "\n" for row in found if "failed" not in row))
    for text in flat(rows):
        print(text)


def arm_key(row: dict) -> tuple:
    """What names an arm in its rows: a stream's rows share it (one per length read), a decode run's its model's."""
    policy = "" if row["part"] == "decode" else (row.get("policy") or "").removesuffix(" (one forward)")
    one = bool(row.get("one")) or (row.get("policy") or "").endswith(" (one forward)")
    return row["part"], row["model"], policy, row.get("length"), one


def recorded(path: str | None, arms: list[dict]) -> list[dict]:
    """The rows `--json` already holds for arms of this run (a rerun's resume); a torn last line is skipped."""
    if not path or not Path(path).exists():
        return []
    wanted, rows = {arm_key(arm) for arm in arms}, []
    for text in Path(path).read_text().splitlines():
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            continue
        if arm_key(row) in wanted:
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
