"""Entry point of ``python -m train``."""

import sys

from train.cli import main

sys.exit(main())
