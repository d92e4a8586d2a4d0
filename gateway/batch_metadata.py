"""What a batch's metadata may hold.

The Batch API refuses anything more, and `tiergate batch submit` checks the same before
it uploads the input file (a refusal after the upload left the file behind). A leaf
module, so the command line loads none of the server to check it.
"""

from __future__ import annotations

from typing import Any

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def metadata_problem(metadata: dict[Any, Any]) -> tuple[str, str] | None:
    """(message, param) for the first thing wrong with `metadata`, or None if it is fine."""
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"metadata may hold at most {MAX_METADATA_PAIRS} pairs.", "metadata"
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str):
            return (
                f"metadata keys are strings of at most {MAX_METADATA_KEY_CHARS} characters "
                "and values are strings.",
                f"metadata.{key}",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            return (
                f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters.",
                f"metadata.{key}",
            )
    return None
