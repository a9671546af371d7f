"""`python -m bench.ttft`: see bench.ttft.cli."""

from bench.ttft.cli import main

main()
