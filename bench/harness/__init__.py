"""What every benchmark runs on: the services as real processes (services.py), the shaped link
(shaping.py: the spec and tc; netns.py: namespaces and veth; relay.py: delay and rate in
userspace; linkprobe.py: what the link does), workloads and model scales (workloads.py), the
trained pairs (pairs.py), what a row ran on (provenance.py), CPU per stage (cpu_stages.py) and
FLOP counts (flops.py).

May import: shared, producer, consumer, qa; no other bench package.
"""
