"""Scheduling: filters → scorers → picker over the eligible engines, and the placement rule per
topology. Face: ``scheduler`` (the decision), ``request`` (what is asked), ``types`` (what plugins
see of an engine). The plugins, prefix memory and placement rules are its rooms (docs/scheduling.md).
"""

__all__ = ["request", "scheduler", "types"]
