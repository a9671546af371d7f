"""The exact-answer policies over a rebuilt cache: the cache audit's report, fallback, upgrade
and repair (audit_policy.py), anchor-token repair (repair.py) and verified decoding (verify.py).

May import: consumer/request/, consumer/auto/, consumer/link/, consumer/engine/, shared.
"""
