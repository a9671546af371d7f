"""Transfer codecs. Importing this package registers every built-in codec."""

from shared.codecs import oracle, quant, raw, recompute, scd  # noqa: F401  (registration side effect)
from shared.codecs.base import (  # noqa: F401
    CacheDecoder,
    Capture,
    Codec,
    LayerEncoder,
    LayerState,
    StreamInfo,
    create_codecs,
    lookup,
    register,
    registered,
)
