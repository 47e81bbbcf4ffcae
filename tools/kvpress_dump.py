"""kvpress's own kept sets on one context, for kvevict's parity test (`tests/test_kvpress_parity.py`).

Runs in an environment of its own (`make test-kvpress` builds `.venv-kvpress` with kvpress pinned: kvpress
0.5.5 needs transformers < 5.3, kvevict >= 5.20), so it imports nothing from kvevict. It reads the token ids
kvevict wrote (`tools/kvpress_ids.py`) and the dequantised model folder kvevict keeps in its cache, runs each
press of `PRESSES` at each compression ratio in one prefill (`with press(model): model(ids)`, kvpress's own
hook: NVIDIA/kvpress, `kvpress/presses/base_press.py`), and records which entries each (layer, KV head)
kept: a scorer press's `compress` returns the kept keys, found again among the layer's keys (exact copies),
and Ada-KV's returns every key with the dropped ones listed in `module.masked_key_indices`
(`kvpress/presses/adakv_press.py`). KVzip is no scorer press: its context manager reconstructs the
context after the prefill and leaves the dropped entries in `module.masked_key_indices`
(`kvpress/presses/kvzip_press.py`, `compress_post`), read the same way. The kept sets are written as
packed bits `[layers, H_kv, T / 8]` per press and ratio, with the ids and the versions, to one
compressed npz. `--only NAME,...` runs those presses alone and merges them into an existing `--out`.

    .venv-kvpress/bin/python tools/kvpress_dump.py --model DIR --ids ids.npy --out tests/data/kvpress_kept.npz
"""

from __future__ import annotations

import argparse
from importlib.metadata import version

import numpy as np
import torch

RATIOS = (0.5, 0.25)


def presses(ratio: float) -> dict:
    """The presses compared, each at its kvpress defaults (the spec kvevict runs is in the test)."""
    import kvpress

    return {
        "expected-attention": kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        "lagkv": kvpress.LagKVPress(compression_ratio=ratio),
        "tova": kvpress.TOVAPress(compression_ratio=ratio),
        "knorm": kvpress.KnormPress(compression_ratio=ratio),
        "keydiff": kvpress.KeyDiffPress(compression_ratio=ratio),
        "snapkv": kvpress.SnapKVPress(compression_ratio=ratio),
        "pyramidkv": kvpress.PyramidKVPress(compression_ratio=ratio),
        "adakv-snapkv": kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio)),
        "adakv-expected-attention": kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio)),
        "kvzip": kvpress.KVzipPress(compression_ratio=ratio),
        "kvzip-layerwise": kvpress.KVzipPress(compression_ratio=ratio, layerwise=True),
    }


def masked_kept(model, heads: int, total: int) -> np.ndarray:
    """`[layers, H_kv, T]` bool: every key but those each layer lists in `module.masked_key_indices`."""
    masks = []
    for layer in model.model.layers:
        mask = np.ones((heads, total), dtype=bool)
        _, head, slot = (t.numpy() for t in layer.self_attn.masked_key_indices)
        mask[head, slot] = False
        masks.append(mask)
    return np.stack(masks)


def kept_mask(keys: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
    """`[H_kv, T]` bool: which of `keys` `[1, H_kv, T, D]` are among `kept` `[1, H_kv, m, D]` (exact rows)."""
    heads, total = keys.shape[1], keys.shape[2]
    mask = np.zeros((heads, total), dtype=bool)
    for h in range(heads):
        where = {row.tobytes(): i for i, row in enumerate(keys[0, h].float().numpy())}
        for row in kept[0, h].float().numpy():
            mask[h, where[row.tobytes()]] = True
    return mask


def run_press(model, ids: torch.Tensor, press) -> np.ndarray:
    """`[layers, H_kv, T]` bool kept by `press` in one prefill of `ids` `[1, T]`."""
    from transformers import DynamicCache

    masks: dict[int, np.ndarray] = {}
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        out_keys, out_values = original(module, hidden_states, keys, values, attentions, kwargs)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None and out_keys.shape == keys.shape:  # Ada-KV: every key stays, the dropped masked
            mask = np.ones(keys.shape[1:3], dtype=bool)
            _, heads, slots = (t.numpy() for t in masked)
            mask[heads, slots] = False
        else:
            mask = kept_mask(keys, out_keys)
        masks[module.layer_idx] = mask
        return out_keys, out_values

    import kvpress

    if isinstance(press, kvpress.KVzipPress):  # scores after the prefill, by reconstruction
        with torch.inference_mode():
            with press(model):
                model(ids, past_key_values=DynamicCache())
            kept = masked_kept(model, model.config.num_key_value_heads, ids.shape[1])
        for module in model.modules():
            if hasattr(module, "masked_key_indices"):
                module.masked_key_indices = None
        return kept
    press.compress = compress
    with torch.inference_mode(), press(model):
        model(ids, past_key_values=DynamicCache())
    for module in model.modules():  # Ada-KV leaves its mask on the modules
        if hasattr(module, "masked_key_indices"):
            module.masked_key_indices = None
    return np.stack([masks[i] for i in sorted(masks)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the dequantised model folder (config + safetensors)")
    parser.add_argument("--ids", required=True, help="token ids [T] (.npy) written by tools/kvpress_ids.py")
    parser.add_argument("--out", required=True, help="the npz to write")
    parser.add_argument("--only", default="", help="presses to run (comma-separated), merged into an existing --out")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.from_numpy(np.load(args.ids)).long()[None]
    out = {"ids": ids[0].numpy().astype(np.int32), "ratios": np.array(RATIOS)}
    if only:
        with np.load(args.out) as before:
            if not np.array_equal(before["ids"], out["ids"]):
                raise SystemExit(f"{args.out} holds other ids: dump every press afresh (leave --only out)")
            out.update({key: before[key] for key in before.files if key not in out})
    for ratio in RATIOS:
        for name, press in presses(ratio).items():
            if only and name not in only:
                continue
            kept = run_press(model, ids, press)
            out[f"{name}@{ratio}"] = np.packbits(kept, axis=-1)
            print(f"{name} at {ratio}: {kept.sum(axis=-1).mean():.1f} kept per head (of {kept.shape[-1]})")
    out["versions"] = np.array([f"kvpress {version('kvpress')}", f"transformers {version('transformers')}",
                                f"torch {version('torch')}"])
    np.savez_compressed(args.out, **out)


if __name__ == "__main__":
    main()
