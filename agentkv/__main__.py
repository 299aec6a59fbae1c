"""`python -m agentkv`: the same entry point as the `agentkv` command."""

import sys

from agentkv.cli import main

sys.exit(main())
