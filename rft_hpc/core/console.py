"""The consoles every command prints through (one place for width and wrapping rules)."""

from __future__ import annotations

import sys

from rich.console import Console

# Messages never wrap (paths stay greppable); tables get room when output is not a terminal.
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
