"""`python -m kvtier`: the `kvtier` command."""

import sys

from kvtier.cli import main

sys.exit(main())
