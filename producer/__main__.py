"""`python -m producer`: run the producer service until SIGTERM/SIGINT, then drain (flags: --help)."""

import os
import sys

# gRPC core logs (a rejected TLS handshake, ...) are not JSON lines: errors only, unless asked for
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from producer.server import ProducerServer
from shared.config import ProducerConfig
from shared.serving import main

if __name__ == "__main__":
    main("producer", ProducerConfig, ProducerServer, sys.argv[1:])
