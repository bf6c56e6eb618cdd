"""`python -m attnserve`: the same command as the `attnserve` script."""

import sys

from attnserve.cli import main

sys.exit(main())
