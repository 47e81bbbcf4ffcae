"""The sink map against eager attention, and `sinkauto` against a direct computation of its sinks."""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache, KvevictError, parse_policy
from kvevict.eval.forward import body
from kvevict.eval.sinkmap import sink_map
from kvevict.policies.sinkauto import SinkAuto

from conftest import make_tiny, random_tokens
from support import attn, cli_error


def eager_attentions(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per layer `[H_q, T, T]` attention probabilities from transformers' own eager attention."""
    with attn(model, "eager"), torch.inference_mode():
        out = model(tokens[None], output_attentions=True)
    return [a[0].double() for a in out.attentions]


def test_sink_map_equals_eager_attention(tiny):
    tokens = random_tokens(96, seed=21)
    before = tiny.config._attn_implementation
    result = sink_map(tiny, None, tokens, k=6, threshold=0.1, min_heads=0.1)
    assert tiny.config._attn_implementation == before  # the model's own attention is back
    probs = eager_attentions(tiny, tokens)
    t = tokens.numel()
    for layer, p in enumerate(probs):
        probe = p[:, t // 2 :, : t // 4]  # distant queries (second half) on early keys (first quarter)
        expected = probe.mean(dim=1)  # [H_q, T/4]
        torch.testing.assert_close(torch.tensor(result.share[layer]).double(), expected[:, :6], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(result.scan_share[layer]).double(), expected, rtol=1e-4, atol=1e-5)
    grid = torch.stack([p[:, t // 2 :, : t // 4].mean(dim=1) for p in probs])  # [L, H, T/4]
    strong = (grid >= 0.1).sum(dim=(0, 1))
    expected_sinks = [pos for pos in range(t // 4) if strong[pos] >= 0.1 * grid.shape[0] * grid.shape[1]]
    assert [s["position"] for s in result.sinks] == expected_sinks
    data = result.to_dict()
    assert data["k"] == 6 and len(data["share"]) == 2 and len(data["position_mean"]) == t // 4


def test_sink_map_bad_input(tiny):
    with pytest.raises(KvevictError, match="at least 64"):
        sink_map(tiny, None, random_tokens(40))
    with pytest.raises(KvevictError, match="k must be"):
        sink_map(tiny, None, random_tokens(80), k=30)


def test_sinkauto_parses_and_checks_budget():
    policy = parse_policy("sinkauto+window")
    assert isinstance(policy, SinkAuto) and policy.n_sinks == 4 and policy.spec() == "sinkauto4+window"
    assert parse_policy("sinkauto2+h2o:recent=0.25").spec() == "sinkauto2+h2o:recent=0.25"
    assert parse_policy("sinkauto+snapkv:window=8").query_window == 8
    with pytest.raises(KvevictError, match="pinned sinks"):
        EvictingCache(make_tiny(), "sinkauto+window", budget=4)
    with pytest.raises(KvevictError, match="at least 1 sink"):
        parse_policy("sinkauto0+window")


def calibration_sinks(model, tokens: torch.Tensor, calib: int, n: int) -> list[torch.Tensor]:
    """Per layer `[H_kv, n]`: the positions < calib that received the most attention from every query of the
    prefill, summed over the query heads of each KV head, from eager attention."""
    probs = eager_attentions(model, tokens)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    sinks = []
    for p in probs:
        received = p.sum(dim=1)[:, :calib]  # [H_q, calib]
        per_kv = received.reshape(-1, group, calib).sum(dim=1)
        sinks.append(per_kv.topk(n, dim=-1).indices.sort(dim=-1).values)
    return sinks


@pytest.mark.parametrize("inner", ["window", "h2o", "snapkv:window=8"])
def test_sinkauto_pins_the_most_attended_calibration_positions(tiny, inner):
    # prefill of 48 tokens: the calibration (first 32 positions) is measured on all 48 queries
    tokens = random_tokens(140, seed=31)
    spec = f"sinkauto3+{inner}"
    policy = SinkAuto(3, parse_policy(inner), calib=32)
    cache = EvictingCache(tiny, [policy], budget=48)
    with torch.inference_mode():
        body(tiny, tokens[:48][None], cache)
        for t in range(48, 140):
            body(tiny, tokens[t : t + 1][None], cache)
    expected = calibration_sinks(tiny, tokens[:48], calib=32, n=3)
    for layer in range(tiny.config.num_hidden_layers):
        found = cache.layers[layer].state_of(policy).sinks[0].sort(dim=-1).values
        assert found.tolist() == expected[layer].tolist(), (spec, layer)
        kept = cache.layers[layer].kept_positions()[0]
        for head in range(kept.shape[0]):
            assert set(expected[layer][head].tolist()) <= set(kept[head].tolist())
            if inner == "window":
                # the rest is exactly the most recent budget - 3 tokens
                rest = sorted(set(kept[head].tolist()) - set(expected[layer][head].tolist()))
                assert rest == list(range(140 - 45, 140))


def test_sinkauto_calibrates_token_by_token_and_on_early_eviction(tiny):
    tokens = random_tokens(60, seed=5)
    policy = SinkAuto(2, parse_policy("window"), calib=16)
    cache = EvictingCache(tiny, [policy], budget=10)  # evicts before 16 tokens were seen
    with torch.inference_mode():
        for t in range(60):
            body(tiny, tokens[t : t + 1][None], cache)
    for layer in range(tiny.config.num_hidden_layers):
        sinks = cache.layers[layer].state_of(policy).sinks
        assert sinks is not None and sinks.shape[-1] == 2 and bool((sinks < 11).all())
        kept = cache.layers[layer].kept_positions()[0]
        for head in range(kept.shape[0]):
            assert set(sinks[0, head].tolist()) <= set(kept[head].tolist())


@pytest.mark.model
def test_embedded_model_sinks_include_position_zero():
    from kvevict.data import load_tokens
    from kvevict.loading import load_model

    model, tokenizer = load_model("smollm2-135m")
    ids, _ = load_tokens("pg-essays", tokenizer, 512)
    result = sink_map(model, tokenizer, ids, k=4)
    assert result.sinks and result.sinks[0]["position"] == 0
    # from the middle of the network on, distant queries park a large share on token 0
    late = [row["pos0"] for row in result.table()[12:]]
    assert sum(late) / len(late) > 0.2


def test_sink_map_figure(tiny):
    import numpy as np

    from kvevict.report.plots import png
    from kvevict.report.task_plots import sink_map_figure

    data = sink_map(tiny, None, random_tokens(80, seed=2), k=4).to_dict()
    data["sinks"] = [{"position": 0, "token": "<s>", "mean_share": 0.5, "heads_over_threshold": 8}]
    fig = sink_map_figure(data)
    by_position, by_head, profile = fig.axes[:3]  # then two colorbars
    share = np.array(data["share"])  # [layers, heads, k]
    assert np.allclose(by_position.images[0].get_array(), share.mean(axis=1))  # layer x position
    assert np.allclose(by_head.images[0].get_array(), share.sum(axis=2))  # layer x head
    assert by_position.get_ylabel() == "layer" and by_head.get_xlabel() == "query head"
    assert [bar.get_height() for bar in profile.patches] == pytest.approx(data["position_mean"][:128])
    assert [t.get_text() for t in profile.texts] == ["0 '<s>'"]  # the named sink
    assert png(fig).startswith(b"\x89PNG")


def test_sinks_cli(tiny_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from kvevict.cli import app

    runner = CliRunner()
    image = tmp_path / "map.png"
    result = runner.invoke(app, ["sinks", "--model", str(tiny_dir), "--tokens", "128", "--k", "4", "--png", str(image),
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["k"] == 4 and len(data["share"]) == 2 and len(data["share"][0]) == 4 and len(data["tokens"]) == 4
    assert image.read_bytes().startswith(b"\x89PNG")
    for args, needle in ((["--tokens", "32"], "at least 64"), (["--tokens", "128", "--k", "40"], "--k must be"),
                         (["--threshold", "1.5"], "--threshold")):
        cli_error("sinks", "--model", "/nonexistent", *args, needles=(needle,))
