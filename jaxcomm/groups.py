"""Replica groups: DiLoCo's outer step between separate programs (:class:`GroupOuter`).

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import groups as _groups
from jaxcomm._src.groups import *  # noqa: F403

__all__ = list(_groups.__all__)
