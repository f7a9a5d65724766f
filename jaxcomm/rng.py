"""Counter-based random bits shared by the stochastic codecs.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import rng as _rng
from jaxcomm._src.rng import *  # noqa: F403

__all__ = list(_rng.__all__)
