"""Type stubs for motor._fast.splice (a spliced chat render's structure key and plan)."""
from typing import Any

def shape_of(messages: list[object], flags: object
             ) -> tuple[tuple[object, ...], list[str]] | None:
    """(structure key, contents) of ``messages``; ``None`` when not spliceable."""

def plan_of(seg_plans: tuple[tuple[str | int, ...], ...], idx: tuple[int, ...],
            contents: list[str], prefix: str, memo: list[str] | None = None
            ) -> list[str | int] | None:
    """The added-token split of the spliced text from its segments' splits; ``None`` when a
    piece holding a content holds ``prefix``. ``memo``: the structure's last pieces with a
    content, reused when equal (updated)."""

NOT_KNOWN: object

def plan_known(shapes: dict[Any, Any], messages: list[object], flags: object,
               prefix: str, missing: object) -> Any:
    """``SpliceCache.plan`` of a structure in ``shapes`` in one call: the plan, ``None`` (not
    spliceable, or a content holds ``prefix``), or ``NOT_KNOWN`` (structure not there, or its
    ``splits`` is ``missing``)."""
