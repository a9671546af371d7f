"""`python -m consumer`: run the consumer service until SIGTERM/SIGINT, then drain (flags: --help)."""

import sys

from consumer.server import ConsumerServer
from shared.config import ConsumerConfig
from shared.service_main import main

if __name__ == "__main__":
    main("consumer", ConsumerConfig, ConsumerServer, sys.argv[1:])
