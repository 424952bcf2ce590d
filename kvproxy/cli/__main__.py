"""`python -m kvproxy.cli …`: the same as the `kvproxy` command."""

import contextlib
import sys

from kvproxy.cli import main

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
