"""Placement rules: which engines run one request. Each module answers for one topology (union,
handoff with its trigger variant, the hybrid fallback) on top of the scheduler's shared steps
(``Placer``: choose an engine of a role, commit a placement); ``Scheduler.place`` picks the rule."""

__all__ = ["handoff", "hybrid", "union"]
