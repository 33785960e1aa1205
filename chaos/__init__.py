"""Squall's fault-injection suite: a real cluster, a recorded workload, seeded faults, a checker.

`make chaos SEED=... DURATION=...` runs it; docs/chaos.md describes the faults, the history
format (chaos/history.py) and what the checker proves.
"""
