"""The chat template render by splicing (:mod:`motor.coordinator.chat_splice`): which
templates the static check lets through, and the spliced text equal to jinja's whole
render for them, whatever the contents."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from motor.coordinator.chat_splice import SpliceCache, splice_safe
from motor.coordinator.tokenize import RoutingTokenizer, TokenizeError
from motor.protocol.chat_tokenizer import CHAT_TEMPLATE
from motor.sim.tokenizer import write_model_dir

ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                    extensions=["jinja2.ext.loopcontrols"])

#: the shape of Qwen2.5's template without tools: contents output with ``+``, the system
#: message read as ``messages[0]['content']``, roles tested
QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

#: the shape of Llama 3's: the system message trimmed, every content piped through trim
LLAMA3_LIKE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}")

#: a content named or conditioned inside a branch the type tests leave alive
SAFE = [
    CHAT_TEMPLATE,
    QWEN_LIKE,
    "{% for m in messages %}{{ m.role }}: {{ m.content if m.content is string else '' }}\n"
    "{% endfor %}",
    "{% for m in messages if m.role != 'tool' %}{% set c = m['content'] %}"
    "{% if c is not string %}{{ c | tojson }}{% else %}[{{ c }}]{% endif %}{% endfor %}",
    "{% for m in messages[1:] %}{{ m['content'] ~ '|' ~ loop.index }}{% endfor %}"
    "{{ messages | length }}",
]

#: each reads a content (or could) in a way its text depends on
UNSAFE = [
    LLAMA3_LIKE,
    "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}",
    "{% for m in messages %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% endfor %}",
    "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}",
    "{{ messages | tojson }}",
    "{% for m in messages %}{% if '<think>' in m.content %}x{% endif %}{{ m.content }}"
    "{% endfor %}",
    "{% for m in messages %}{{ m.content[0] }}{% endfor %}",
    "{% for m in messages %}{{ m.content.split('x')[0] }}{% endfor %}",
    "{% for m in messages %}{% if m.content is lower %}x{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ loop.nextitem['content'] if loop.nextitem }}{% endfor %}",
    "{% for m in messages %}{% set c = m.content %}{% set c = 'x' %}{{ c }}{% endfor %}",
    "{% macro r(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ r(m) }}{% endfor %}",
    "{% for m in messages %}{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}",
    "{% for m in messages %}{{ (m.content ~ 'x') | length }}{% endfor %}",
    "{% for m in messages %}{{ m.content if m.content|length > 3 else 'short' }}{% endfor %}",
    "{% for m in messages %}{% set ns = namespace(c=m.content) %}{{ ns.c }}{% endfor %}",
    "{% for m in messages %}{{ m[m.role] }}{% endfor %}",
    "{% for m in messages %}{{ m }}{% endfor %}",
    "{% for c in messages[0].content %}{{ c }}{% endfor %}",
]


@pytest.mark.parametrize("source", SAFE)
def test_templates_that_only_output_contents_are_splice_safe(source: str) -> None:
    assert splice_safe(ENV.parse(source))


@pytest.mark.parametrize("source", UNSAFE)
def test_templates_that_read_a_content_are_not(source: str) -> None:
    assert not splice_safe(ENV.parse(source))


def _whole(source: str):
    t = ENV.from_string(source)

    def render(messages: list, add_gen: object) -> str:
        return t.render(messages=messages, add_generation_prompt=add_gen, bos_token="<s>",
                        eos_token="</s>")
    return render


# contents with everything a template or the cut could trip over: NULs, the placeholders'
# own look, jinja syntax, special tokens, empty strings, non-ASCII
CONTENT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "\x000\x00", "\x001:\x00", "{{ x }}", "{% if %}",
                     "<|im_end|>", "  padded  ", "ünï ✓", "\n"]))
ROLE = st.sampled_from(["system", "user", "assistant"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLE, "content": CONTENT}), min_size=1,
                    max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=st.sampled_from(SAFE), batch=st.lists(MESSAGES, min_size=1, max_size=4),
       add_gen=st.booleans())
def test_spliced_render_is_the_whole_render(source: str, batch: list, add_gen: bool) -> None:
    whole = _whole(source)
    cache = SpliceCache(max_shapes=2)       # small: evictions happen too
    for messages in batch:
        got = cache.render(messages, add_gen, whole)
        assert got == whole(messages, add_gen)
    assert cache.hits + cache.misses == len(batch)


def test_a_chat_outside_the_spliced_form_is_left_to_the_whole_render() -> None:
    cache = SpliceCache()
    whole = _whole(CHAT_TEMPLATE)
    for messages in ([{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                     [{"role": "user", "content": None}],
                     [{"role": "user", "content": "x", "tool_calls": []}],
                     [{"role": 3, "content": "x"}],
                     [{"role": "user", "content": "x", "name": 5}]):
        assert cache.render(messages, True, whole) is None
    assert len(cache) == 0


def test_a_structure_the_template_refuses_is_rendered_whole_each_time() -> None:
    calls = []

    def refusing(messages: list, add_gen: object) -> str:
        calls.append(1)
        raise ValueError("roles must alternate")
    cache = SpliceCache()
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert cache.render(msgs, True, refusing) is None
    assert cache.render(msgs, True, refusing) is None
    assert len(calls) == 1          # the structure is remembered as not spliced


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tok"))


def test_the_routing_tokenizer_splices_the_sims_template(model_dir: Path) -> None:
    tok = RoutingTokenizer(str(model_dir))
    assert tok._splice is not None
    whole = _whole(CHAT_TEMPLATE)
    for i in range(3):
        msgs = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": f"question {i} <|im_end|>"}]
        body = {"messages": msgs}
        text = tok.render_chat(body)
        assert text == whole(msgs, True).replace("<s>", "")
        assert tok.chat_ids(body) == tok.encode_chat(text)
        assert tok.plan_chat(body) == (text, tok.chat_plan(text))   # "<|" in a content
    # render_chat: one miss, then hits; chat_ids and plan_chat: the structure's segment
    # splits made once from the cut (a hit), then each a render of its own (a content holds
    # the added tokens' prefix: the plan cannot come from the splice)
    assert (tok._splice.misses, tok._splice.hits) == (1, 9)


def test_the_plan_of_a_spliced_chat_is_the_split_of_its_text(model_dir: Path) -> None:
    tok = RoutingTokenizer(str(model_dir))
    for i, extra in enumerate(({}, {"add_generation_prompt": False})):
        msgs = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": f"question {i}", "name": "ann"},
                {"role": "assistant", "content": ""},      # an empty piece is dropped
                {"role": "user", "content": "<| not a token"}]
        body = {"messages": msgs, **extra}
        for cut in (4, 3):          # with and without the prefix in a content
            b = {**body, "messages": msgs[:cut]}
            text, plan = tok.plan_chat(b)
            want = tok.render_chat(b)
            assert plan == tok.chat_plan(want)
            assert text == (want if cut == 4 else None)
    assert tok.plan_chat({"messages": msgs[:3], "tools": [{"type": "function"}]})[0] \
        is not None                 # other template inputs: rendered whole


def _tokenizer_with(tmp_path: Path, template: str) -> RoutingTokenizer:
    """The sim's tokenizer directory with ``template`` as its chat template."""
    d = write_model_dir(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return RoutingTokenizer(str(d))


def test_template_errors_still_reach_the_request(tmp_path: Path) -> None:
    tok = _tokenizer_with(tmp_path, "{% for m in messages %}{% if loop.index0 % 2 == 0 and "
                                    "m.role != 'user' %}{{ raise_exception('user first') }}"
                                    "{% endif %}{{ m.content }}{% endfor %}")
    assert tok._splice is not None
    for _ in range(2):
        with pytest.raises(TokenizeError, match="user first"):
            tok.render_chat({"messages": [{"role": "assistant", "content": "x"}]})
    assert tok.render_chat({"messages": [{"role": "user", "content": "ok"}]}) == "ok"


def test_a_template_that_trims_is_rendered_whole(tmp_path: Path) -> None:
    tok = _tokenizer_with(tmp_path, LLAMA3_LIKE)
    assert tok._splice is None
    msgs = [{"role": "system", "content": "  sys  "}, {"role": "user", "content": " hi "}]
    assert tok.render_chat({"messages": msgs}) == \
        "<|start_header_id|>system<|end_header_id|>\n\nsys" \
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"


def test_token_sets_the_segments_split_cannot_stand_for_are_split_whole(tmp_path: Path) -> None:
    from motor.coordinator.tokenize import _splice_plans_exact
    chatml = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert _splice_plans_exact("<|", chatml)
    assert not _splice_plans_exact("<|", chatml + ("<|im_end|>X",))   # a prefix of another
    assert not _splice_plans_exact("<<", ("<<a>>", "<<b>>"))          # "<<" has a border
    assert not _splice_plans_exact("", ("a", "b"))
    # a segment's last token and the content's first character make a longer token
    from tokenizers import AddedToken, Tokenizer
    sim = write_model_dir(tmp_path / "sim")
    d = tmp_path / "longer"
    d.mkdir()
    tk = Tokenizer.from_file(str(sim / "tokenizer.json"))
    tk.add_special_tokens([AddedToken("<|im_end|>X", normalized=False)])
    tk.save(str(d / "tokenizer.json"))
    cfg = json.loads((sim / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n<|im_end|>"
                            "{{ m.content }}\n{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = RoutingTokenizer(str(d))
    assert tok._splice is not None and not tok._splice_plans
    body = {"messages": [{"role": "user", "content": "X and more"}]}
    text = tok.render_chat(body)
    assert tok.plan_chat(body) == (text, tok.chat_plan(text))
    assert tok.chat_ids(body) == tok._tok.encode(text, add_special_tokens=False).ids


_FLAG_BODIES = [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": None},
    {"continue_final_message": True, "add_generation_prompt": False},
    {"tools": [{"type": "function"}]},
    {"documents": [{"title": "d", "text": "t"}]},
    {"tools": None, "documents": None},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template_kwargs": {}},
    {"chat_template_kwargs": "not a dict"},
    {"chat_template_kwargs": ["a", "list"]},
    {"chat_template_kwargs": 1},
    {"chat_template_kwargs": None},
]


@pytest.mark.parametrize("extra", _FLAG_BODIES, ids=[json.dumps(b) for b in _FLAG_BODIES])
def test_render_chat_and_plan_chat_splice_by_one_rule(model_dir: Path, extra: dict) -> None:
    tok = RoutingTokenizer(str(model_dir))
    assert tok._splice is not None and tok._splice_plans
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a question"},
            {"role": "assistant", "content": "The answer"}]
    body = {"messages": msgs, **extra}
    cache = tok._splice
    seen = cache.hits + cache.misses
    text = tok.render_chat(body)
    spliced = cache.hits + cache.misses > seen          # render_chat used the splice cache
    kwargs = extra.get("chat_template_kwargs")
    whole = bool(extra.get("tools") or extra.get("documents")
                 or (isinstance(kwargs, dict) and kwargs))
    assert spliced == (not whole)       # a chat_template_kwargs that is not a dict: ignored
    got_text, plan = tok.plan_chat(body)
    assert plan == tok.chat_plan(text)
    assert tok.assemble(plan) == tok._tok.encode(text, add_special_tokens=False).ids
    # the plan comes from the splice exactly where render_chat splices, unless the text must
    # be cut after the final message (continue_final_message)
    cont = bool(extra.get("continue_final_message"))
    assert (got_text is None) == (spliced and not cont)
    assert got_text in (None, text)


def test_a_chat_template_kwargs_that_is_not_a_dict_is_ignored(model_dir: Path) -> None:
    tok = RoutingTokenizer(str(model_dir))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = tok.render_chat({"messages": msgs})
    for kwargs in ("enable_thinking", ["x"], 3, True):
        body = {"messages": msgs, "chat_template_kwargs": kwargs}
        assert tok.render_chat(body) == want
        text, plan = tok.plan_chat(body)
        assert text is None and plan is not None        # spliced, as render_chat
        assert tok.assemble(plan) == tok.encode(want)
        assert tok.chat_ids(body) == tok._tok.encode(want, add_special_tokens=False).ids


def test_a_structures_cut_and_plan_are_one_entry_bounded_alike(model_dir: Path) -> None:
    tok = RoutingTokenizer(str(model_dir))
    whole, split, pre = tok._render_messages, tok._split_segment, tok._split_fast[0]
    roles = (["user"], ["system", "user"], ["user", "assistant", "user"])

    def chat(k: int, text: str) -> list:
        return [{"role": r, "content": f"{text} {i}"} for i, r in enumerate(roles[k])]

    def want(msgs: list) -> list:
        return tok.chat_plan(whole(msgs, True))

    cache = SpliceCache(max_shapes=2)
    assert cache.plan(chat(0, "a"), True, whole, split, pre) == want(chat(0, "a"))
    assert (cache.misses, cache.hits, len(cache)) == (1, 0, 1)
    assert cache.render(chat(0, "b"), True, whole) == whole(chat(0, "b"), True)
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)     # the same entry
    assert cache.render(chat(1, "c"), True, whole) == whole(chat(1, "c"), True)
    assert cache.plan(chat(1, "d"), True, whole, split, pre) == want(chat(1, "d"))
    assert (cache.misses, cache.hits, len(cache)) == (2, 2, 2)     # its split made on a hit
    assert cache.plan(chat(1, "e"), True, whole, split, pre) == want(chat(1, "e"))
    assert (cache.misses, cache.hits) == (2, 2)                    # kept: no lookup counted
    assert cache.plan(chat(2, "f"), True, whole, split, pre) == want(chat(2, "f"))
    assert (cache.misses, len(cache)) == (3, 2)                    # the oldest went, whole
    assert cache.plan(chat(0, "g"), True, whole, split, pre) == want(chat(0, "g"))
    assert (cache.misses, len(cache)) == (4, 2)
    one = SpliceCache(max_shapes=1)     # a structure's split goes with its cut
    one.plan(chat(0, "a"), True, whole, split, pre)
    one.render(chat(1, "b"), True, whole)
    assert one.plan(chat(0, "c"), True, whole, split, pre) == want(chat(0, "c"))
    assert (one.misses, one.hits, len(one)) == (3, 0, 1)
    none = SpliceCache(max_shapes=0)                               # nothing kept
    for text in ("h", "i"):
        assert none.plan(chat(2, text), True, whole, split, pre) == want(chat(2, text))
        assert none.render(chat(2, text), False, whole) == whole(chat(2, text), False)
    assert (none.misses, none.hits, len(none)) == (4, 0, 0)
