"""Plans as values and files: what a plan is, how it is saved, checked and explained.

Owns :class:`~partitioner.plans.plan.Plan` and its parts (``plan``, frozen and validated),
the JSON schema of plan files (``plan_schema.json``), model fingerprints
(``fingerprint``), hand-written specs (``spec``) and the table of a plan's candidates
(``explain``). A plan loaded from a file needs nothing else to print or explain itself.

May import: ``partitioner.errors`` and ``partitioner.runtime`` (schedule and checkpoint
names). Never the planner or the cost model.
"""
