"""``python -m rlwire.trainer.bench``: the modes' benchmark (:mod:`rlwire.trainer.tools.bench`)."""

from __future__ import annotations

from .tools.bench import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
