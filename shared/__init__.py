"""Code common to the producer and consumer services: wire bridge, codecs, model loading,
configuration, logging and server lifecycle. Nothing here knows which side it runs on."""

__version__ = "0.1.0"
API_VERSION = "scd.v1"
