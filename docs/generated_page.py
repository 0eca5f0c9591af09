"""The command line of a script that writes a docs page from the code: write it, or `--check` that the committed
page is what the code says (exit 1 naming the script to run when it is not)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional


def write_or_check(page: Path, render: Callable[[], str], description: str, argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed page differs")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        page.write_text(text)
    elif page.read_text() != text:
        sys.exit(f"{page} differs from the code: run `python docs/{Path(sys.argv[0]).name}`")
