"""Codecs: the payloads that cross the wire (packed ``uint8`` codes, ``int32`` indices,
scales), their encoders and decoders, and the codec classes of the one protocol
(``encode(x, key)``, ``decode(payload)``, ``nbytes(shape)``) that a pipeline boundary
(:class:`jaxcomm.pipeline.RowCodec`) and an error-fed aggregator (:func:`jaxcomm.error_fed`)
take.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import codec as _codec
from jaxcomm._src import codecs as _codecs
from jaxcomm._src.codec import *  # noqa: F403
from jaxcomm._src.codecs import *  # noqa: F403
from jaxcomm._src.signsgd import stochastic_sign_encode
from jaxcomm._src.sparse import compression_gain

__all__ = [*_codecs.__all__, *_codec.__all__, "stochastic_sign_encode", "compression_gain"]
