"""AR-Topk's adaptive compression ratio: trials, the knee of the trade-off, the collective
chosen per ratio.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import adaptive as _adaptive
from jaxcomm._src.adaptive import *  # noqa: F403

__all__ = list(_adaptive.__all__)
