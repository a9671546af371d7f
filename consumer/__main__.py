"""`python -m consumer`: run the consumer service until SIGTERM/SIGINT, then drain (flags: --help)."""

import sys

from shared.config import ConsumerConfig
from shared.serving import main
from consumer.server import ConsumerServer

if __name__ == "__main__":
    main("consumer", ConsumerConfig, ConsumerServer, sys.argv[1:])
