"""Every wrapper around every registered policy: it runs, and it is its inner policy in every declaration and
hook it does not change.

A storage form (`q8+`, `q4+`, `q2+`, `fp8+`, KIVI's `q4:keys=channel+`) changes how kept entries are held,
never which stay; sink pinning (`sinkN+`) changes what is pinned and the budget the inner policy runs on.
What each changes is written here, from what the wrapper means, not read off its code; every other
capability field and every other public method of `Policy` must answer as the inner policy's (methods
enumerated from `Policy` itself, so a new hook is checked the day it is added). Each combination is then
streamed through a tiny model the way a command runs it: the model's add-BOS settled first
(`with_stream_start`, which `llamacpp` and `ollama` read), the preset's position mode taken. A storage form
around a policy whose scores read neither attention nor keys must keep exactly what the bare policy keeps
(the codes move no score); around any policy it holds as many entries as the bare one after every forward.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from kvevict import EvictingCache, KvevictError, parse_policy
from kvevict.eval.forward import body
from kvevict.policies import REGISTRY, AttentionRequest, Policy, QueryBatch, SlotView, shared_batches
from kvevict.policies.capabilities import FIELDS
from kvevict.policies.engine_defaults import run_positions, with_stream_start

from conftest import make_tiny, random_tokens
from policy_matrix import TEST_OPTIONS

MODEL = make_tiny(seed=21, layers=2)
CHUNKS = [10, 1, 5, 1]  # a prefill at the budget, a decode step, a chunk that evicts inside itself, a step
TOKENS = random_tokens(sum(CHUNKS), seed=22)
BUDGET = 10
SINKS = 2
GROUP = 8  # the tiny model's head_dim is 16
STORAGE = [f"q8:group={GROUP}", f"q4:group={GROUP}", f"q2:group={GROUP}", "fp8", f"q4:group={GROUP},keys=channel"]
WRAPPERS = [*STORAGE, f"sink{SINKS}"]


def inner_spec(name: str) -> str:
    """A registered policy at options that fit BUDGET; an engine preset as a user writes it, its model-read
    options (llama.cpp's add-BOS) left to the run, as the commands leave them."""
    return name if parse_policy(name).preset else TEST_OPTIONS.get(name, name)


INNER = [inner_spec(name) for name in REGISTRY]


def refusal(wrapper: str, inner: Policy) -> str | None:
    """The words of the one-line refusal a combination must meet, None where it must run: a policy scored by
    reconstruction runs bare (`kvzip`), and an engine preset is its engine's whole rule, with its own sink
    option, so sink pinning refuses to wrap it."""
    if inner.reconstructs:
        return "kvzip"
    if inner.preset and wrapper.startswith("sink"):
        return "wraps an engine preset"
    return None


# --- declarations: what each wrapper changes, everything else the inner policy's ------------------------------

def changed_fields(wrapper: str, inner: Policy) -> dict:
    """The capability fields `wrapper` changes, with the values they must take."""
    if wrapper.startswith("sink"):
        # it pins its sinks; a window behind them evicts first in, first out after them; a budget bounds it
        return {"pinned": max(SINKS, inner.pinned), "unbounded": False,
                "fifo_after": SINKS if inner.fifo_after == 0 else inner.fifo_after}
    return {"kv_storage": "a storage form"}


#: per hook of `Policy`, the calls that compare a wrapper with its inner policy (a hook not listed fails the test)
def _budgets(p: Policy):
    return [_outcome(p.check_budget, b) for b in range(1, 3 * BUDGET)]


def _outcome(call, *args):
    """What `call(*args)` answers, or the kind of error it raises (a refusal is an answer too)."""
    try:
        return call(*args)
    except (KvevictError, NotImplementedError) as exc:
        return type(exc)


HOOK_CALLS = {
    "evict_to": lambda p: [_outcome(p.evict_to, BUDGET, held) for held in range(1, 4 * BUDGET)],
    "head_floor": lambda p: [p.head_floor(b) for b in range(SINKS + 1, 3 * BUDGET)],
    "layer_budgets": lambda p: [p.layer_budgets(b, 4) for b in range(SINKS + 4, 3 * BUDGET)],
    "check_budget": _budgets,
    "arrival": lambda p: _outcome(p.arrival, torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(3))),
    "new_state": lambda p: _state_kind(p.new_state(1)),
}
# hooks that return a policy, and hooks that read a view: checked by their own functions below
REWRAPPING = ("with_seed", "with_stream_start")
VIEW_HOOKS = ("request", "absorb", "scores")
#: what sink pinning changes: the budget its inner policy runs on, and the pinned slots' scores
SINK_CHANGES = {"head_floor", "layer_budgets", "check_budget", *VIEW_HOOKS}


def _state_kind(state):
    if isinstance(state, torch.Generator):
        return ("generator", state.initial_seed())
    return type(state)


def public_hooks() -> list[str]:
    """Every public method of `Policy` but `spec` (a wrapper names itself)."""
    return [n for n, v in vars(Policy).items() if inspect.isfunction(v) and not n.startswith("_") and n != "spec"]


def test_every_hook_of_policy_is_checked_here():
    assert sorted(public_hooks()) == sorted([*HOOK_CALLS, *REWRAPPING, *VIEW_HOOKS])


def view_for(policy: Policy, state) -> SlotView:
    """A layer's view `[1, 2 heads, 13 slots]` out of positional order, every statistic the policy declares
    filled, keys and values `[1, 2, 13, 16]`: seeded, so two calls give the same view."""
    g = torch.Generator().manual_seed(5)
    n, seen = 13, 40
    positions = torch.stack([torch.cat([torch.arange(3), torch.randperm(seen - 3, generator=g)[: n - 3] + 3])
                             for _ in range(2)])[None]
    stats = {name: torch.rand(1, 2, n, generator=g) for name in policy.stats}
    keys, values = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    return SlotView(positions, seen, BUDGET, 0, stats, lambda: keys, values=lambda: values, state=state)


def measured(request: AttentionRequest) -> torch.Tensor | QueryBatch:
    """What the cache would hand `absorb` for `request`: attention mass `[1, 2, 13]`, or the queries."""
    g = torch.Generator().manual_seed(9)
    if request.kind == "queries":
        inv = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)

        def rotation(pos):
            angles = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)  # [p, 16]
            return angles.cos(), angles.sin()

        return QueryBatch(torch.randn(1, 4, 6, 16, generator=g), torch.arange(34, 40), rotation, 40)
    return torch.rand(1, 2, 13, generator=g)


def view_hooks(policy: Policy) -> list:
    """`request`, `absorb` and `scores` of `policy` on the same view, each with a fresh state of layer 0."""
    out = []
    for will_evict in (False, True):
        view = view_for(policy, policy.new_state(0))
        request = policy.request(view, will_evict)
        out.append(request)
        if request is not None:
            out.append(policy.absorb(view, request, measured(request)))
        out.append(policy.scores(view_for(policy, policy.new_state(0))))
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_declarations(wrapper: str, spec: str) -> None:
    inner, wrapped = parse_policy(spec), parse_policy(f"{wrapper}+{spec}")
    # what a run settles first: the model's add-BOS (llamacpp's `pinned` cannot be read before)
    inner, wrapped = inner.with_stream_start(False), wrapped.with_stream_start(False)
    changed = changed_fields(wrapper, inner)
    for name in FIELDS:
        if name == "kv_storage" and name in changed:
            assert wrapped.kv_storage is not None and inner.kv_storage is None, (wrapper, spec)
        else:
            assert getattr(wrapped, name) == changed.get(name, getattr(inner, name)), (wrapper, spec, name)
    hooks_changed = SINK_CHANGES if wrapper.startswith("sink") else set()
    for name, call in HOOK_CALLS.items():
        if name not in hooks_changed:
            assert same(call(wrapped), call(inner)), (wrapper, spec, name)
    if not hooks_changed:
        assert same(view_hooks(wrapped), view_hooks(inner)), (wrapper, spec)


def check_rewrapping(wrapper: str, spec: str) -> None:
    """`with_seed` and `with_stream_start` reach the inner policy (llama.cpp's add-BOS through `q4+`); where
    the inner policy answers itself, so does the wrapper, so a spec stays as written."""
    inner, wrapped = parse_policy(spec), parse_policy(f"{wrapper}+{spec}")
    for call in (lambda p: p.with_seed(7), lambda p: p.with_stream_start(True), lambda p: p.with_stream_start(False)):
        answer, own = call(wrapped), call(inner)
        assert type(answer) is type(wrapped) and type(answer.inner) is type(own), (wrapper, spec)
        assert answer.inner.spec() == own.spec(), (wrapper, spec)
        assert (answer is wrapped) == (own is inner), (wrapper, spec)
        assert {f.name: getattr(answer, f.name) for f in dataclasses.fields(answer) if f.name != "inner"} == {
            f.name: getattr(wrapped, f.name) for f in dataclasses.fields(wrapped) if f.name != "inner"}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_wrapper_declares_and_answers_as_its_inner_policy_but_for_what_it_changes(wrapper):
    for spec in INNER:
        if refusal(wrapper, parse_policy(spec)) is None:
            check_declarations(wrapper, spec)
            check_rewrapping(wrapper, spec)


# --- a short stream of every combination -------------------------------------------------------------------

def stream(specs: list[str]) -> dict[str, list[list[torch.Tensor]]]:
    """Per spec, each layer's kept positions `[1, H, n]` after each forward of CHUNKS: the specs settled and
    run in their position mode as a command runs them, as rows of one cache where they share a mode and may share
    a cache (`shared_batches`)."""
    out = {}
    settled = dict(zip(with_stream_start(specs, adds_bos=False), specs))
    modes = {spec: run_positions([spec], None) for spec in settled}
    for batch in [b for mode in set(modes.values()) for b in shared_batches([s for s in settled if modes[s] == mode])]:
        cache = EvictingCache(MODEL, batch, budget=BUDGET, positions=modes[batch[0]], per_token=True)
        kept, seen = [], 0
        with torch.inference_mode():
            for q in CHUNKS:
                body(MODEL, TOKENS[None, seen:seen + q].expand(len(batch), -1), cache)
                seen += q
                kept.append([layer.kept_positions() for layer in cache.layers])  # [rows, H, n] each
        for row, spec in enumerate(batch):
            out[settled[spec]] = [[layer[row:row + 1] for layer in forward] for forward in kept]
    return out


@pytest.fixture(scope="module")
def bare() -> dict[str, list[list[torch.Tensor]]]:
    """Every registered policy's kept positions, streamed unwrapped (`kvzip` never evicts as it reads)."""
    return stream([spec for spec in INNER if not parse_policy(spec).reconstructs])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_wrapper_around_every_registered_policy_streams(wrapper, bare):
    for spec in INNER:
        words = refusal(wrapper, parse_policy(spec))
        if words is not None:
            with pytest.raises(KvevictError, match=words):
                stream([f"{wrapper}+{spec}"])
    ran = [spec for spec in INNER if refusal(wrapper, parse_policy(spec)) is None]
    kept = stream([f"{wrapper}+{spec}" for spec in ran])
    for spec in ran:
        policy = parse_policy(spec)
        for forward, (ours, theirs) in enumerate(zip(kept[f"{wrapper}+{spec}"], bare[spec])):
            for layer, (a, b) in enumerate(zip(ours, theirs)):
                where = f"{wrapper}+{spec}, forward {forward}, layer {layer}"
                if wrapper.startswith("sink"):  # the first SINKS tokens are held by every head
                    assert all(set(range(SINKS)) <= set(head.tolist()) for head in a[0]), where
                    continue
                assert a.shape == b.shape, where  # the inner policy's schedule
                if not (policy.needs_attention or policy.reads_keys):  # codes move no score: the same entries
                    assert torch.equal(a, b), where
    assert ("llamacpp" in ran and "ollama" in ran) == (not wrapper.startswith("sink"))
