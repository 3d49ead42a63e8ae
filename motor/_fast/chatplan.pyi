"""Type stubs for motor._fast.chatplan (a chat's plan against the piece cache)."""
from collections.abc import Callable
from typing import Any

def plan_cut(plan: list[str | int], pieces: dict[Any, Any]) -> tuple[int, int]:
    """(index of the first text piece not in ``pieces`` (``len(plan)``: none), characters of
    every text piece not in it)."""

def assemble(plan: list[str | int], start: int, cache: Any,
             encode_piece: Callable[[str], list[int]],
             head: list[int] | None = None) -> list[int]:
    """``head``'s ids then those of ``plan[start:]``, text pieces from ``cache`` (a
    ``TokenCache``; a missing one encoded and kept)."""
