"""jaxcomm training programs.

In a source checkout this package is ``train`` and the models are the top-level ``models``
beside it; installed, it is ``jaxcomm_train`` with the models inside it
(``jaxcomm_train.models``), so installing puts no generic top-level name into site-packages.
Modules here import the models as ``.models`` and each other relatively, which works both ways.
"""

import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if __name__ == "train":  # a checkout: ``models/`` sits beside ``train/``
    models = sys.modules.setdefault(f"{__name__}.models", importlib.import_module("models"))

# The shipped configs: ``configs/`` of a checkout, or the copy an installed wheel holds.
CONFIGS_DIR = _HERE / "configs" if (_HERE / "configs").is_dir() else _HERE.parent / "configs"

# How this package's programs are started, for help texts and the hints in messages.
RUN = f"python -m {__name__}"
