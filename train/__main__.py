"""Entry point of ``python -m train``."""

import sys

from .cli import main

sys.exit(main())
