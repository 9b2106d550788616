"""``python -m flatopt``: the ``flatopt`` command (inspect, verify, diff) without a venv's
``bin/`` on PATH."""

from .cli import main

raise SystemExit(main())
