"""``python -m aiote``: the command-line interface."""

import sys

from aiote.cli import main

sys.exit(main())
