"""JSON as the command-line tools print it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, Any


def print_json(payload: Any, file: IO[str] | None = None) -> None:
    """Indented JSON with names in their own letters ("Zoë", not "Zo\\u00eb"), falling back
    to escapes only on a stream whose encoding cannot write them."""
    stream = file if file is not None else sys.stdout
    try:
        print(json.dumps(payload, indent=2, ensure_ascii=False), file=stream)
    except UnicodeEncodeError:
        print(json.dumps(payload, indent=2), file=stream)


def print_subcommand_help(parser: argparse.ArgumentParser) -> int:
    """A command group called without its subcommand (`tiergate usage`): the group's own
    help, on stderr, and the status of a usage error."""
    parser.print_help(sys.stderr)
    return 2
