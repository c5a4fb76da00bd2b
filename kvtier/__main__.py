import sys

from tiering.cli import main

sys.exit(main())
