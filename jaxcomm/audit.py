"""The wire audit: what a compiled program sends, read from its HLO, and its roofline cost.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import audit as _audit
from jaxcomm._src.audit import *  # noqa: F403
from jaxcomm._src.marsit import ROUND_SCOPE
from jaxcomm._src.sparse import ROOT_SCOPE

__all__ = list(_audit.__all__) + ["ROOT_SCOPE", "ROUND_SCOPE"]
