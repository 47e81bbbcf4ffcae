"""Peak memory of scoring a long prompt with H2O statistics: kvevict vs eager attention.

kvevict computes the output with SDPA and the statistics in query blocks; the eager
arm materialises each layer's full [heads, L, L] attention matrix (what
`output_attentions` / eager attention would do) and sums it into the same statistic.
Each arm runs in a fresh subprocess; its peak resident memory above the loaded
model is reported side by side.

    .venv/bin/python benchmarks/attention_memory.py --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ARM = r"""
import json, resource, sys, torch
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import eager_attention_forward
from kvevict import EvictingCache, load_model, load_tokens
from kvevict.eval.forward import body
arm, n = sys.argv[1], int(sys.argv[2])
model, tok = load_model("smollm2-135m")
tokens, repeated = load_tokens("pg-essays", tok, n)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sums = {}
def eager_h2o(module, q, k, v, mask, scaling=None, **kw):
    causal = torch.full((q.shape[2], k.shape[2]), float("-inf")).triu(1)[None, None]
    out, w = eager_attention_forward(module, q, k, v, causal, scaling=scaling, **kw)
    g = q.shape[1] // k.shape[1]
    sums[module.layer_idx] = w.view(1, k.shape[1], g, q.shape[2], -1).sum(dim=(2, 3))
    return out, None
with torch.inference_mode():
    if arm == "kvevict":
        cache = EvictingCache(model, "h2o", budget=n + 1)
        body(model, tokens[None], cache)
        stat = cache.layers[0].stats["h2o_attention"][:, :, :n]
    else:
        AttentionInterface.register("eager_h2o", eager_h2o)
        model.set_attn_implementation("eager_h2o")
        model.model(input_ids=tokens[None], use_cache=False)
        stat = sums[0]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weighted = float((stat[0] * torch.arange(n, dtype=stat.dtype)).sum() / stat.sum())
print(json.dumps({"arm": arm, "peak_mb": peak / 1024, "above_model_mb": (peak - base) / 1024,
                  "layer0_checksum": weighted}))
"""


def run(arm: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", ARM, arm, str(tokens)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    ours, eager = run("kvevict", args.tokens), run("eager", args.tokens)
    print(f"H2O statistics over a {args.tokens}-token prompt, SmolLM2-135M, peak RSS above the loaded model")
    print(f"{'arm':<10}{'peak MB':>10}{'above model MB':>16}{'layer-0 sum':>14}")
    for r in (ours, eager):
        print(f"{r['arm']:<10}{r['peak_mb']:>10.0f}{r['above_model_mb']:>16.0f}{r['layer0_checksum']:>14.1f}")
    print(f"eager / kvevict (above model): {eager['above_model_mb'] / max(1.0, ours['above_model_mb']):.1f}x")
    print("layer-0 sum = attention-weighted mean key position of the statistic: equal in both arms")


if __name__ == "__main__":
    main()
