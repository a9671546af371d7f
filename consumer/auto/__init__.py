"""Mode `auto`: what each way of getting the context's KV costs here (planner.py, learned from
finished requests), the choice among them within the request's loss budget (chooser.py), what
this consumer's transfers left in the producer's store (producer_memory.py), background probes
that keep the estimates fresh (probe.py) and the default mode (defaults.py).

May import: consumer/link/, consumer/engine/, shared.
"""
