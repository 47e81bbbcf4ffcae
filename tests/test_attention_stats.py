"""The attention-statistics kernel (`kvevict.attention_stats`) against eager attention written here: every
query head over its KV head's keys repeated, a plain float64 softmax over the masked scores, reduced as each
entry promises. Every blocked entry runs at several bounds (one query per block, a few, all at once), and
the observer the workspace carries must never see a block above the bound.

Tolerances: the kernel computes in float32 and the reference in float64, so values agree to float32's
rounding (1e-5 absolute on probabilities and their sums over tens of queries). Between bounds the results
agree to float32's rounding, not bit for bit: the sums add the blocks' sums in another order (~1e-7 relative
per block), and the BLAS may give a smaller block's products other last bits.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.attention_stats import (
    Mask,
    QueryRows,
    Workspace,
    attend,
    column_sums,
    covariance_bias,
    probability_blocks,
    products,
    query_attention,
    query_probs,
)

SCALE = 0.3


def eager(query, keys, hidden, bias=None):
    """`[B, H_q, m, n]` float64 probabilities: keys repeated per query head, `hidden` `[B, H_q or 1, m or 1, n]`
    (True hides) masked to -inf, one softmax over all of them."""
    group = query.shape[1] // keys.shape[1]
    scores = query.double() @ keys.double().repeat_interleave(group, dim=1).transpose(-1, -2) * SCALE
    if bias is not None:
        scores = scores + bias.double()
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


def per_kv_head(probs, heads):
    """`[B, H_q, m, n]` -> `[B, H_kv, group, m, n]`."""
    b, hq, m, n = probs.shape
    return probs.view(b, heads, hq // heads, m, n)


def draw(seed, b=2, hq=6, hkv=3, m=20, n=50, d=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, m, d, generator=g), torch.randn(b, hkv, n, d, generator=g), \
        torch.randn(b, hkv, n, d, generator=g), g


def recorder():
    seen: list[int] = []
    return seen, seen.append


def test_one_query_probabilities_and_output_equal_eager():
    """The single-block path: a sliding band hidden (a replay step), and a bias with a mask (Expected
    Attention's expected query over the entries after its sinks)."""
    query, keys, values, g = draw(0, m=1)
    band = torch.arange(50) < 13
    out, probs = query_attention(query, keys, values, SCALE, band)
    ref = eager(query, keys, band.expand(1, 1, 1, 50))
    torch.testing.assert_close(probs, per_kv_head(ref, 3)[:, :, :, 0].float(), atol=1e-6, rtol=1e-5)
    want = ref @ values.double().repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    bias = torch.randn(2, 3, 2, 50, generator=g)
    sinks = (torch.arange(50) < 4)[None, None, None]
    got = query_probs(query, keys, SCALE, sinks, bias)
    ref = eager(query, keys, sinks, bias.view(2, 6, 1, 50))
    torch.testing.assert_close(got, per_kv_head(ref, 3)[:, :, :, 0].float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_attend_reduces_causal_masked_attention_as_eager(rows):
    """Keys in a different order per row and head, some hidden (another head's entries), queries causal by
    position: the output, H2O's sums, TOVA's last row and KVzip's maxima."""
    query, keys, values, g = draw(1)
    key_pos = torch.stack([torch.randperm(50, generator=g) * 2 for _ in range(6)]).view(2, 3, 50)
    hidden = torch.rand(2, 3, 50, generator=g) < 0.2
    query_pos = torch.arange(60, 80)
    seen, observe = recorder()
    bound = rows * 2 * 6 * 50 * 4
    done = attend(query, keys, SCALE, Workspace(bound, observe), Mask(hidden, key_pos, query_pos), values=values,
                  sums=True, last=True, maxima=True)
    hide = hidden[:, :, None, :] | (key_pos[:, :, None, :] > query_pos[:, None])  # [B, H_kv, m, n]
    ref = eager(query, keys, hide.repeat_interleave(2, dim=1))
    grouped = per_kv_head(ref, 3)
    torch.testing.assert_close(done.out, (ref @ values.double().repeat_interleave(2, dim=1)).float(),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(done.sums, grouped.sum(dim=(2, 3)).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(done.last, grouped[:, :, :, -1].sum(dim=2).float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(done.maxima, grouped.amax(dim=(2, 3)).float(), atol=1e-6, rtol=1e-5)
    assert len(seen) == -(-20 // rows) and max(seen) <= bound


def test_attend_in_blocks_agrees_with_one_block_to_float32s_rounding():
    query, keys, values, _ = draw(2)
    mask = Mask(key_pos=torch.arange(50).expand(2, 3, 50), query_pos=torch.arange(30, 50))
    whole = attend(query, keys, SCALE, Workspace(), mask, values=values, sums=True, last=True, maxima=True)
    blocked = attend(query, keys, SCALE, Workspace(4 * 2 * 6 * 50 * 4), mask, values=values, sums=True, last=True,
                     maxima=True)
    for name in ("out", "sums", "last", "maxima"):
        torch.testing.assert_close(getattr(blocked, name), getattr(whole, name), atol=1e-6, rtol=1e-6)


def test_a_whole_row_read_by_every_query_head_is_masked_per_kv_head():
    """The per-head layer's layout: one row buffer `[B, 1, n, D]` read by all query heads, each KV head seeing
    only its own entries (`hidden` per head): the same as each KV head's own keys with the others hidden."""
    query, keys, values, g = draw(3)
    row_keys, row_values = keys[:, :1], values[:, :1]
    owner = torch.randint(0, 3, (2, 50), generator=g)
    hidden = owner[:, None, :] != torch.arange(3)[None, :, None]  # [B, H_kv, n]
    done = attend(query, row_keys, SCALE, Workspace(3 * 2 * 6 * 50 * 4), Mask(hidden), values=row_values,
                  sums=True, heads=3)
    ref = eager(query, row_keys.expand(-1, 3, -1, -1), hidden.repeat_interleave(2, dim=1)[:, :, None])
    torch.testing.assert_close(done.out, (ref @ row_values.double().expand(-1, 6, -1, -1)).float(),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(done.sums, per_kv_head(ref, 3).sum(dim=(2, 3)).float(), atol=1e-5, rtol=1e-5)


def test_alive_sets_per_query_and_products_of_the_callers_own():
    """A replay's masks (what each query saw at its step) over logits the caller makes per block (the
    position shift rotates its queries per block): here the plain product, so eager attention is the reference."""
    query, keys, values, g = draw(4)
    alive = torch.rand(2, 3, 20, 50, generator=g) < 0.7
    alive[..., 0] = True
    done = attend(query, keys, SCALE, Workspace(6 * 2 * 6 * 50 * 4), Mask(alive=alive), values=values,
                  products=lambda a, z: products(query[:, :, a:z], keys))
    ref = eager(query, keys, ~alive.repeat_interleave(2, dim=1))
    torch.testing.assert_close(done.out, (ref @ values.double().repeat_interleave(2, dim=1)).float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 20])
def test_query_rows_hand_out_each_querys_logits_and_each_blocks_output(rows):
    query, keys, values, g = draw(5)
    alive = torch.rand(2, 3, 20, 50, generator=g) < 0.6
    alive[..., 0] = True
    seen, observe = recorder()
    bound = rows * 2 * 6 * 50 * 4
    stepper = QueryRows(lambda a, z: products(query[:, :, a:z], keys), 20, 2 * 6 * 50, SCALE, Workspace(bound, observe))
    plain = query.double() @ keys.double().repeat_interleave(2, dim=1).transpose(-1, -2) * SCALE
    outs = []
    for i in range(20):
        torch.testing.assert_close(stepper.row(i), per_kv_head(plain, 3)[:, :, :, i].float(), atol=1e-5, rtol=1e-5)
        if stepper.ends_block(i):
            outs.append(stepper.attend_block(alive[:, :, stepper.start : stepper.stop], values))
    ref = eager(query, keys, ~alive.repeat_interleave(2, dim=1))
    torch.testing.assert_close(torch.cat(outs, dim=2), (ref @ values.double().repeat_interleave(2, dim=1)).float(),
                               atol=1e-5, rtol=1e-5)
    assert len(seen) == -(-20 // rows) and max(seen) <= bound


@pytest.mark.parametrize("rows", [1, 4, 20])
def test_probability_blocks_and_column_sums_equal_eager(rows):
    query, keys, _, g = draw(6)
    key_pos = torch.stack([torch.randperm(50, generator=g) for _ in range(6)]).view(2, 3, 50)
    query_pos = torch.arange(30, 50)
    hide = (key_pos[:, :, None, :] > query_pos[:, None]).repeat_interleave(2, dim=1)
    ref = per_kv_head(eager(query, keys, hide), 3)
    bound = rows * 2 * 6 * 50 * 4
    seen, observe = recorder()
    got = torch.cat([probs for _, probs in probability_blocks(query, keys, SCALE, Workspace(bound, observe),
                                                              Mask(key_pos=key_pos, query_pos=query_pos))], dim=3)
    torch.testing.assert_close(got, ref.float(), atol=1e-6, rtol=1e-5)
    sums = column_sums(query, query_pos, keys, key_pos, SCALE, Workspace(bound, observe))
    torch.testing.assert_close(sums, ref.sum(dim=(2, 3)).float(), atol=1e-5, rtol=1e-5)
    assert max(seen) <= bound


def test_no_block_exceeds_the_bound_on_a_context_it_could_not_hold():
    """2,048 queries over 2,048 keys at 4 query heads would be 64 MiB of logits at once; under a 1 MiB
    workspace every block the kernel materialises stays within it, for every blocked entry."""
    g = torch.Generator().manual_seed(7)
    n, bound = 2048, 1 << 20
    query, keys = torch.randn(1, 4, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    positions = torch.arange(n)
    assert 1 * 4 * n * n * 4 == 64 * bound
    seen, observe = recorder()
    workspace = Workspace(bound, observe)
    sums = column_sums(query, positions, keys, positions, SCALE, workspace)
    done = attend(query, keys, SCALE, workspace, Mask(key_pos=positions.expand(1, 2, n), query_pos=positions),
                  values=keys, last=True, maxima=True)
    assert len(seen) > 64 and max(seen) <= bound
    torch.testing.assert_close(sums.sum(), torch.tensor(4.0 * n), rtol=1e-4, atol=0)  # every query's row sums to 1
    assert done.out.shape == query.shape


@pytest.mark.parametrize("workspace", [None, Workspace(bytes=3 * 4 * (2 * 4 * 3 * 16))])
def test_the_covariance_term_in_blocks_of_keys_is_each_keys_quadratic_form(workspace):
    """`covariance_bias` against `k^T S k` written per key in float64, in one block (the default bound) and
    in blocks of three keys over eleven (the last one short)."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 4, 11, 16, generator=g)  # [B, H_kv, n, D]
    factor = torch.randn(2, 4, 3, 16, 16, generator=g)
    cov = factor @ factor.transpose(-1, -2) / 16  # [B, H_kv, group, D, D], positive semi-definite
    expected = torch.empty(2, 4, 3, 11, dtype=torch.float64)
    for b, h, q, n in ((b, h, q, n) for b in range(2) for h in range(4) for q in range(3) for n in range(11)):
        k = keys[b, h, n].double()
        expected[b, h, q, n] = k @ cov[b, h, q].double() @ k
    if workspace is not None:
        assert workspace.rows(2 * 4 * 3 * 16) == 3
    torch.testing.assert_close(covariance_bias(keys, cov, workspace).double(), expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_imports_torch_alone():
    """The engine and the policies both stand on the kernel (docs/architecture.md), so it imports neither:
    nothing of kvevict outside its own package, nothing beyond torch and the standard library."""
    import ast
    from pathlib import Path

    import kvevict.attention_stats as package

    allowed = {"__future__", "collections.abc", "dataclasses", "torch"}
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module in allowed, f"{path.name} imports {node.module}"
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1, f"{path.name} imports from outside the package"
            elif isinstance(node, ast.Import):
                assert {alias.name for alias in node.names} <= allowed, f"{path.name} imports {node.names[0].name}"
