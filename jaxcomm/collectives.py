"""Collectives built from point-to-point sends, each logging what it sends.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import collectives as _collectives
from jaxcomm._src.collectives import *  # noqa: F403
from jaxcomm._src.marsit import SignReduced, sign_all_reduce, sign_merge

__all__ = list(_collectives.__all__) + ["SignReduced", "sign_all_reduce", "sign_merge"]
