"""Codecs: the payloads that cross the wire (packed ``uint8`` codes, ``int32`` indices,
scales) and their encoders and decoders.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import codecs as _codecs
from jaxcomm._src.codecs import *  # noqa: F403
from jaxcomm._src.signsgd import stochastic_sign_encode
from jaxcomm._src.sparse import compression_gain

__all__ = list(_codecs.__all__) + ["stochastic_sign_encode", "compression_gain"]
