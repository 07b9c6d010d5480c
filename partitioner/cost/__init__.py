"""The cost model: what devices are, and what a model's layers cost on them.

Owns the device and link specs (``devices``: data only, presets and the reference CPU),
per-layer compute costs (``cost``), collectives by the alpha-beta model (``comm``), memory
per device (``memory``), analytic GPT workloads (``transformer_model``), and measuring this
machine (``measure`` for the CPU and the layers, ``machine`` for choosing a local device's
spec: pinned, cached or measured once). Nothing here measures unless ``measure`` is asked.

May import: ``partitioner.errors``, ``partitioner.passes`` (graph annotations) and
``partitioner.runtime`` (the measurement runs a real pipeline). Never the planner.
"""
