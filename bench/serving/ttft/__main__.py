"""`python -m bench.serving.ttft`: see bench.serving.ttft.cli."""

from bench.serving.ttft.cli import main

main()
