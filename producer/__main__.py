"""`python -m producer`: run the producer service until SIGTERM/SIGINT, then drain (flags: --help)."""

import sys

from producer.server import ProducerServer
from shared.config import ProducerConfig
from shared.service_main import main

if __name__ == "__main__":
    main("producer", ProducerConfig, ProducerServer, sys.argv[1:])
