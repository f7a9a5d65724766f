"""Elastic resume: how each piece of state is resized to another number of workers.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import elastic as _elastic
from jaxcomm._src.elastic import *  # noqa: F403

__all__ = list(_elastic.__all__)
