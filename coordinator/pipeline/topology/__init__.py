"""Topology: how one prompt reaches its engines. Face: ``dispatcher`` (a prompt's answer or stream,
with relay), ``attempts`` (admission, outcomes and deaths of each attempt), ``legs`` (the stream a
placement opens), ``trigger`` (the P/D trigger's board, which the metaserver answers on).
"""

__all__ = ["attempts", "dispatcher", "legs", "trigger"]
