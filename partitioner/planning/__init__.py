"""Planning: from costed layers to the plan a runtime executes.

Owns the exact stage-split solver (``solver``: numbers in, boundaries out), manual splits
(``manual``: ``balance=``, ``split_points=``), one configuration's prediction
(``predict``), the ``strategy="auto"`` search (``auto``), the discrete-event simulator
(``simulate``), predictions as plan records (``records``), tensor-parallel rules
(``tp_rules``) and the planner that turns an analysed model and a request into a
:class:`~partitioner.plans.plan.Plan` (``planner``).

May import: ``partitioner.errors``, ``partitioner.cost``, ``partitioner.plans``,
``partitioner.passes``, ``partitioner.runtime`` (the schedule registry), and the front's
inputs ``partitioner.analysis`` and ``partitioner.request``.
"""
