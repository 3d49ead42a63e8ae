"""A chat template's render by splicing: the template rendered once per message structure
with placeholders for the contents, the request's contents spliced into that text.

kv_affinity's routing key needs the prompt text the engine builds from a chat (the model's
jinja chat template); jinja's ``Template.render`` costs about 57 k instructions for a short
two-message chat (``bench/kv_key_stages.py``), more than the rest of the routing key. Most
templates do nothing with a message's content but output it, so the text is the same for
every chat of one structure (roles, names, template flags) with the contents put in.

That is exact only for templates that never look into a content. :func:`splice_safe`
establishes it statically on the template's syntax tree (jinja2's own parser, once per
template): every expression that can hold a content (``message['content']``,
``message.content``, a variable set to one, text concatenated with one) may only be output
(``{{ }}``, with ``~`` or ``+`` to other text) or be the operand of a type test whose
outcome is the same for every string (``is string``, ``is none``, ``is defined``...), and
those tests are folded so their dead branches (a list-of-parts content's filters) are not
looked at. Anything else (a filter such as ``trim``, a method call, a comparison, ``in``,
a truth test, an index, a macro, a filter block, the messages passed whole to ``tojson``)
makes the template not splice-safe, and it is rendered whole as before.

:class:`SpliceCache` keeps, per message structure, the placeholder render cut at the
placeholders (checked at fill against a second render with placeholders of other lengths),
and once :meth:`SpliceCache.plan` asks for it, each segment's added-token split.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from jinja2 import nodes

from motor._fast.splice import NOT_KNOWN, plan_known, plan_of, shape_of

#: what a type test answers for any ``str`` (jinja2's tests of those names)
_STR_TESTS = {"string": True, "defined": True, "undefined": False, "none": False,
              "mapping": False, "iterable": True, "sequence": True, "number": False,
              "integer": False, "float": False, "boolean": False, "true": False,
              "false": False, "callable": False}
#: attribute names of a message that reach its content without naming it (``.get``...)
_DICT_ATTRS = frozenset(dir(dict))

#: kinds of values the check follows
_LIST, _MSG, _TEXT = "messages", "message", "content"

SPLICE_MAX_SHAPES = 512


class _Unsafe(Exception):
    pass


class _Check:
    """The walk of :func:`splice_safe` (raises :class:`_Unsafe`)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {"messages": _LIST}

    # -- expressions ------------------------------------------------------------------
    def kind(self, n: nodes.Node) -> str | None:
        """What ``n`` may hold (``_LIST`` / ``_MSG`` / ``_TEXT``: a content or text made with
        one; ``None``: nothing of a content), its subexpressions checked."""
        if isinstance(n, nodes.Name):
            return self.names.get(n.name)
        if isinstance(n, nodes.Const | nodes.TemplateData):
            return None
        if isinstance(n, nodes.Getitem):
            k = self.kind(n.node)
            if k == _LIST:
                if isinstance(n.arg, nodes.Slice):
                    self.plain_children(n.arg)
                    return _LIST
                self.plain(n.arg)
                return _MSG
            if k == _MSG:
                if isinstance(n.arg, nodes.Const) and isinstance(n.arg.value, str):
                    return _TEXT if n.arg.value == "content" else None
                raise _Unsafe("a message indexed by a computed key")
            if k is not None:
                raise _Unsafe("a content indexed")
            self.plain(n.arg)
            return None
        if isinstance(n, nodes.Getattr):
            if n.attr in ("previtem", "nextitem"):
                raise _Unsafe("loop.previtem / loop.nextitem (a message not followed)")
            k = self.kind(n.node)
            if k == _MSG:
                if n.attr == "content":
                    return _TEXT
                if n.attr in _DICT_ATTRS:
                    raise _Unsafe(f"a message's .{n.attr}")
                return None
            if k is not None:
                raise _Unsafe(f"an attribute of a {k}")
            return None
        if isinstance(n, nodes.Filter) and n.node is not None:
            k = self.kind(n.node)
            self.plain_args(n)
            if k == _LIST and n.name in ("length", "count") and not n.args:
                return None
            if k == _LIST and n.name in ("first", "last") and not n.args:
                return _MSG
            if k is not None:
                raise _Unsafe(f"a {k} filtered by {n.name}")
            return None
        if isinstance(n, nodes.Test):
            # a type test's outcome is the same for every string (and every message dict):
            # a bool, folded by truth() where it decides a branch; other tests could read
            # the value (``is lower``, ``is eq(...)``)
            if self.kind(n.node) is not None and (n.name not in _STR_TESTS or n.args
                                                  or n.kwargs):
                raise _Unsafe(f"a test {n.name} of a message or content")
            self.plain_args(n)
            return None
        if isinstance(n, nodes.Concat):
            return self.text_of(n.nodes)
        if isinstance(n, nodes.Add):
            return self.text_of([n.left, n.right])
        if isinstance(n, nodes.CondExpr):
            t = self.truth(n.test)
            ks = []
            if t is not False:
                ks.append(self.kind(n.expr1))
            if t is not True and n.expr2 is not None:
                ks.append(self.kind(n.expr2))
            return self.text_of_kinds(ks)
        self.plain_children(n)
        return None

    def text_of(self, parts: Sequence[nodes.Node]) -> str | None:
        return self.text_of_kinds([self.kind(p) for p in parts])

    @staticmethod
    def text_of_kinds(kinds: list[str | None]) -> str | None:
        if _LIST in kinds or _MSG in kinds:
            raise _Unsafe("a message or the messages joined to text")
        return _TEXT if _TEXT in kinds else None

    def plain(self, n: nodes.Node | None) -> None:
        if n is not None and self.kind(n) is not None:
            raise _Unsafe(f"a content used in {type(n).__name__}")

    def plain_args(self, n: nodes.Filter | nodes.Test | nodes.Call) -> None:
        for a in n.args:
            self.plain(a)
        for kw in n.kwargs:
            self.plain(kw.value)
        self.plain(n.dyn_args)
        self.plain(n.dyn_kwargs)

    def plain_children(self, n: nodes.Node) -> None:
        for c in n.iter_child_nodes():
            k = self.kind(c)
            if k is not None:
                raise _Unsafe(f"a {k} used in {type(n).__name__}")

    def truth(self, test: nodes.Node) -> bool | None:
        """A condition's value when a content decides it alone (a type test of a content),
        else ``None`` (checked as a plain expression)."""
        if isinstance(test, nodes.Not):
            t = self.truth(test.node)
            return None if t is None else not t
        if isinstance(test, nodes.Test) and test.name in _STR_TESTS and not test.args \
                and not test.kwargs and self.kind(test.node) == _TEXT:
            return _STR_TESTS[test.name]
        self.plain(test)
        return None

    # -- statements -------------------------------------------------------------------
    def body(self, stmts: list[nodes.Node]) -> None:
        for s in stmts:
            self.stmt(s)

    def stmt(self, s: nodes.Node) -> None:
        if isinstance(s, nodes.Output):
            for n in s.nodes:
                if self.kind(n) in (_LIST, _MSG):
                    raise _Unsafe("a message or the messages output")
        elif isinstance(s, nodes.For):
            k = self.kind(s.iter)
            if not isinstance(s.target, nodes.Name):
                raise _Unsafe("a loop over several targets")
            name = s.target.name
            if k == _LIST:
                self.names[name] = _MSG
            elif k is not None:
                raise _Unsafe(f"a loop over a {k}")
            elif name in self.names:
                raise _Unsafe(f"{name} shadowed by a loop")
            if s.test is not None:
                self.plain(s.test)
            self.body(s.body)
            self.body(s.else_)
        elif isinstance(s, nodes.If):
            self.if_chain([s, *s.elif_], s.else_)
        elif isinstance(s, nodes.Assign):
            k = self.kind(s.node)
            if isinstance(s.target, nodes.Name):
                name = s.target.name
                if k is not None:
                    self.names[name] = k
                elif name in self.names:
                    raise _Unsafe(f"{name} set to another value")
            elif k is not None:
                raise _Unsafe("a content kept in a namespace or tuple")
            else:
                self.plain_children(s.target)
        elif isinstance(s, nodes.Break | nodes.Continue):
            pass
        else:
            # macros, call and filter blocks, includes, scoped blocks, {% set %} blocks...
            raise _Unsafe(f"{type(s).__name__} statement")

    def if_chain(self, ifs: list[nodes.If], else_: list[nodes.Node]) -> None:
        for branch in ifs:
            t = self.truth(branch.test)
            if t is True:
                self.body(branch.body)
                return                          # later branches are dead
            if t is None:
                self.body(branch.body)
        self.body(else_)


def splice_safe(template: nodes.Template) -> bool:
    """Whether a chat template's text is the same for every chat of one message structure
    with the contents put in (the module's rules), from its syntax tree
    (``Environment.parse(source)``)."""
    try:
        _Check().body(template.body)
    except _Unsafe:
        return False
    return True


def _placeholder(i: int, variant: int) -> str:
    return f"\x00{i}{':' * variant}\x00"


#: a placeholder render cut: the text between placeholders, the message index of each
_Cut = tuple[tuple[str, ...], tuple[int, ...]]
_MISSING: Any = object()


class _Shape:
    """What :class:`SpliceCache` keeps of a message structure: its placeholder render
    ``cut`` (``None``: rendered whole), and for :meth:`SpliceCache.plan`, filled on its
    first call: ``splits``, each segment's added-token split (``None``: not spliceable;
    ``_MISSING``: not made yet), ``idx``, the cut's message indices, and ``memo``, the
    last plan's pieces with a content (:func:`motor._fast.splice.plan_of`)."""

    __slots__ = ("cut", "splits", "idx", "memo")

    def __init__(self, cut: _Cut | None) -> None:
        self.cut = cut
        self.splits: tuple[tuple[str | int, ...], ...] | None = _MISSING
        self.idx: tuple[int, ...] = ()
        self.memo: list[str] = []


_CUT = (re.compile("\x00([0-9]+)\x00"), re.compile("\x00([0-9]+):\x00"))


def _cut(text: str, variant: int) -> _Cut | None:
    """``text`` cut at the placeholders of ``variant``: the text between them and the
    message index of each; ``None`` when a stray NUL is left (not understood)."""
    parts = _CUT[variant].split(text)
    segs = tuple(parts[0::2])
    if any("\x00" in s for s in segs):
        return None
    return segs, tuple(int(x) for x in parts[1::2])


class SpliceCache:
    """Renders of a splice-safe template by message structure (at most ``max_shapes``,
    the oldest dropped first).

    ``render(messages, render_whole)``: the text for ``messages`` (dicts with a string
    ``role`` and ``content``, optionally a string ``name``), or ``None`` when the chat is
    not of a spliceable form (then the caller renders it whole). ``flags``: the other
    template inputs (hashable); ``render_whole(msgs, flags)`` renders the template for a
    message list, used on a miss (an exception it raises: that structure is rendered
    whole from then on, where the same exception reaches the caller).
    """

    def __init__(self, max_shapes: int = SPLICE_MAX_SHAPES) -> None:
        self.max_shapes = max_shapes
        #: structure -> what is kept of it (:class:`_Shape`); the oldest filled goes first
        #: when full (no reordering on a hit: structures are few and stable)
        self._shapes: dict[tuple[object, ...], _Shape] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._shapes)

    def render(self, messages: list[Any], flags: object,
               render_whole: Callable[[list[dict[str, Any]], object], str]) -> str | None:
        got = shape_of(messages, flags)
        if got is None:
            return None
        key, contents = got
        cut = self._shape(key, messages, render_whole).cut
        if cut is None:
            return None                         # this structure does not cut cleanly
        segs, idx = cut
        out = [segs[0]]
        for k, i in enumerate(idx, 1):
            out.append(contents[i])
            out.append(segs[k])
        return "".join(out)

    def plan(self, messages: list[Any], flags: object,
             render_whole: Callable[[list[dict[str, Any]], object], str],
             split: Callable[[str], list[str | int]], prefix: str) -> list[str | int] | None:
        """The added-token split of :meth:`render`'s text without that text: each segment
        of the structure's cut split once by ``split`` (kept), the contents run into the
        pieces around them (:func:`motor._fast.splice.plan_of`). ``None`` when the chat is
        not spliceable or a content may hold an added token (the tokens' common
        ``prefix``): then the caller renders and splits the text."""
        known = plan_known(self._shapes, messages, flags, prefix, _MISSING)
        if known is not NOT_KNOWN:      # a structure seen and split before: one call
            return known  # type: ignore[no-any-return]
        got = shape_of(messages, flags)
        if got is None:
            return None
        key, contents = got
        sh = self._shapes.get(key)
        if sh is None or (splits := sh.splits) is _MISSING:
            sh = self._shape(key, messages, render_whole)
            cut = sh.cut
            if cut is None:
                splits = None
            else:
                splits = tuple(tuple(split(s)) for s in cut[0])
                sh.idx = cut[1]
            sh.splits = splits
        if splits is None:
            return None
        return plan_of(splits, sh.idx, contents, prefix, sh.memo)

    def _shape(self, key: tuple[object, ...], messages: list[Any],
               render_whole: Callable[[list[dict[str, Any]], object], str]) -> _Shape:
        """The structure's entry (made on a miss); ``hits`` / ``misses`` counted."""
        sh = self._shapes.get(key)
        if sh is None:
            self.misses += 1
            return self._fill(key, messages, render_whole)
        self.hits += 1
        return sh

    def _fill(self, key: tuple[object, ...], messages: list[Any],
              render_whole: Callable[[list[dict[str, Any]], object], str]) -> _Shape:
        cuts: list[_Cut | None] = []
        for variant in (0, 1):
            ph = []
            for i, m in enumerate(messages):
                d = dict(m)
                d["content"] = _placeholder(i, variant)
                ph.append(d)
            try:
                text = render_whole(ph, key[0])
            except Exception:  # noqa: BLE001 - the whole render says what is wrong
                cuts = [None, None]
                break
            cuts.append(_cut(text, variant))
        sh = _Shape(cuts[0] if cuts[0] is not None and cuts[0] == cuts[1] else None)
        self._shapes[key] = sh
        if len(self._shapes) > self.max_shapes:
            del self._shapes[next(iter(self._shapes))]
        return sh


__all__ = ["SPLICE_MAX_SHAPES", "SpliceCache", "splice_safe"]
