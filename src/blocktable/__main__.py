"""``python -m blocktable demo``: the same as the ``blocktable`` console script."""

from __future__ import annotations

import sys

from blocktable.cli import main

sys.exit(main())
