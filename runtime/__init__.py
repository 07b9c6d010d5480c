"""Runtimes that execute a plan's stage graphs (schedules, workers, pipelines)."""

__all__: list[str] = []
