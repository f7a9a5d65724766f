"""Pipeline parallelism: GPipe over a ``stage`` axis, the boundary codecs (AQ-SGD's deltas
against a per-sample message buffer, DirectQ, float32) and the buffers.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import aqsgd as _aqsgd
from jaxcomm._src import buffer as _buffer
from jaxcomm._src import pipeline as _pipeline
from jaxcomm._src.aqsgd import *  # noqa: F403
from jaxcomm._src.buffer import *  # noqa: F403
from jaxcomm._src.pipeline import *  # noqa: F403

__all__ = list(_pipeline.__all__) + list(_aqsgd.__all__) + list(_buffer.__all__)
