"""`--policies` lists: a spec's own options are comma-separated like the list, and must stay with their spec."""

from __future__ import annotations

from kvevict.cli.common import split_specs
from kvevict.policies import parse_policy


def test_a_specs_options_stay_with_it():
    text = "q4:group=64,residual=128+full, h2o,,snapkv:window=16,kernel=5 ,fp8:scale=head+sink4+window"
    items = split_specs(text)
    assert items == ["q4:group=64,residual=128+full", "h2o", "snapkv:window=16,kernel=5", "fp8:scale=head+sink4+window"]
    # each item is one spec the policy parser reads back whole, its options included
    quantized = parse_policy(items[0])
    assert (quantized.kv_storage.group, quantized.kv_storage.residual) == (64, 128)
    assert parse_policy(items[2]).spec() == parse_policy("snapkv:kernel=5,window=16").spec()
