"""motor bench datasets: deterministic, right shapes and lengths."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor.bench.datasets import (build_dataset, chat_messages, completion_prompt, random_text,
                                  sample_len)


def test_same_seed_same_dataset_other_seed_differs():
    for name in ("random", "shared-prefix", "multi-turn"):
        a = build_dataset(name, num_requests=20, input_len=50, prefix_len=80, seed=3)
        b = build_dataset(name, num_requests=20, input_len=50, prefix_len=80, seed=3)
        c = build_dataset(name, num_requests=20, input_len=50, prefix_len=80, seed=4)
        assert a == b
        assert a != c


def test_random_dataset_lengths_are_tokens_as_bytes():
    convs = build_dataset("random", num_requests=30, input_len=100, output_len=17, seed=1)
    assert len(convs) == 30
    for c in convs:
        assert c.system is None and len(c.turns) == 1
        assert len(c.turns[0]) == 100 and len(c.turns[0].encode()) == 100
        assert c.turns[0].isascii()
        assert c.max_tokens == (17,)
    assert len({c.turns[0] for c in convs}) == 30  # unique prompts


def test_random_dataset_range_ratio_bounds():
    convs = build_dataset("random", num_requests=300, input_len=100, output_len=40,
                          range_ratio=0.5, seed=2)
    ins = [len(c.turns[0]) for c in convs]
    outs = [c.max_tokens[0] for c in convs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 10
    assert min(outs) >= 20 and max(outs) <= 60


def test_shared_prefix_groups_share_their_prefix():
    convs = build_dataset("shared-prefix", num_requests=12, num_groups=3, prefix_len=200,
                          input_len=40, seed=5)
    assert [c.group for c in convs] == [i % 3 for i in range(12)]
    by_group: dict[int, set[str]] = {}
    for c in convs:
        assert len(c.system) == 200 and len(c.turns) == 1 and len(c.turns[0]) == 40
        by_group.setdefault(c.group, set()).add(c.system)
    assert all(len(s) == 1 for s in by_group.values())            # one prefix per group
    assert len({next(iter(s)) for s in by_group.values()}) == 3   # groups differ
    assert len({c.turns[0] for c in convs}) == 12                 # unique questions
    # completions: prompt = prefix + question, exactly prefix_len + input_len tokens
    p = completion_prompt(convs[0].system, [], convs[0].turns[0])
    assert p.startswith(convs[0].system) and len(p.encode()) == 240


def test_multi_turn_shape_and_growing_history():
    convs = build_dataset("multi-turn", num_conversations=6, turns=5, num_groups=2,
                          prefix_len=64, input_len=30, output_len=9, seed=7)
    assert len(convs) == 6
    for c in convs:
        assert len(c.turns) == 5 and c.max_tokens == (9,) * 5
        assert c.group == c.id % 2 and len(c.system) == 64
    assert convs[0].system == convs[2].system != convs[1].system

    c = convs[0]
    history: list[tuple[str, str]] = []
    prev_msgs: list[dict] | None = None
    prev_prompt: str | None = None
    for i, user in enumerate(c.turns):
        msgs = chat_messages(c.system, history, user)
        prompt = completion_prompt(c.system, history, user, dialog=True)
        assert len(msgs) == 2 + 2 * i
        assert msgs[0] == {"role": "system", "content": c.system}
        if prev_msgs is not None:
            # the history grows: the previous request (+ its answer) is a prefix of this one
            assert msgs[:len(prev_msgs)] == prev_msgs
            assert msgs[len(prev_msgs)] == {"role": "assistant", "content": f"answer{i - 1}"}
            assert prompt.startswith(prev_prompt) and f"answer{i - 1}" in prompt
        prev_msgs, prev_prompt = msgs, prompt
        history.append((user, f"answer{i}"))


def test_multi_turn_without_prefix_has_no_system_message():
    convs = build_dataset("multi-turn", num_conversations=2, turns=2, prefix_len=0, seed=0)
    assert all(c.system is None for c in convs)
    assert chat_messages(None, [], "hi") == [{"role": "user", "content": "hi"}]


def test_unknown_dataset_and_bad_ratio_rejected():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("sharegpt")
    with pytest.raises(ValueError, match="range_ratio"):
        build_dataset("random", range_ratio=1.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.floats(0, 0.99), st.integers(0, 2**32 - 1))
def test_sample_len_within_bounds(length, ratio, seed):
    n = sample_len(np.random.default_rng(seed), length, ratio)
    assert n >= 1
    assert max(1, round(length * (1 - ratio))) <= n <= max(1, round(length * (1 + ratio)))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**32 - 1))
def test_random_text_is_n_ascii_bytes(n, seed):
    t = random_text(np.random.default_rng(seed), n)
    assert len(t.encode()) == n and t.isascii()
    assert not t or not t[0].isspace()
