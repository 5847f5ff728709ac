"""``python -m commsched`` is the ``commsched`` command."""

import sys

from .cli import main

sys.exit(main())
