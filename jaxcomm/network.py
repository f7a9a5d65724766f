"""The network model: links, schedules, stragglers, the alpha-beta cost of collectives, the
simulated clock and the traffic logs every transform keeps.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import network as _network
from jaxcomm._src.network import *  # noqa: F403

__all__ = list(_network.__all__)
