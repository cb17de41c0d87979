"""Old module paths kept for one release: importing one warns and gives the module at its new path."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make module ``old`` (being imported) the module ``new``, with a `DeprecationWarning` naming both."""
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
