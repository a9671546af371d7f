"""Transfer codecs. Importing this package registers every built-in codec."""

from shared.codecs import quant, raw, recompute, scd  # noqa: F401  (registration side effect)
from shared.codecs.base import (  # noqa: F401
    CacheDecoder,
    Capture,
    Codec,
    EncodeRequest,
    LayerEncoder,
    LayerState,
    PayloadSpec,
    Schema,
    StreamInfo,
    create_codecs,
    lookup,
    register,
    registered,
)
