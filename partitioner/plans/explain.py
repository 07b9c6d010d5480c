"""A plan's candidates as a table, and why the chosen one won: ``Plan.explain()``.

Reads only the plan's records (plain data written by ``partitioner.planning.auto.records``),
so a plan loaded from a file explains itself without the planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["explain", "format_bytes", "format_seconds", "given_mesh_line", "one_device_line",
           "tuned_line"]


def explain(records: Sequence[dict[str, Any]], summary: dict[str, Any] | None = None) -> str:
    """Ranked candidates as a table, and why the winner won (from plan records).

    Args:
        records: candidate records, the chosen one first (``Plan.candidates``).
        summary: the search's counts (``records[0]["search"]`` when omitted).
    """
    if not records:
        return "no candidates were recorded (the plan was not costed by the planner)"
    info = summary if summary is not None else records[0].get("search", {})
    ranked = sorted(records, key=lambda r: r.get("rank", 0))
    lines = [line for line in (one_device_line(ranked, info),) if line]
    if info:
        lines.append(f"searched {info['considered']} configurations in "
                     f"{info['elapsed'] * 1e3:.0f} ms: {info['evaluated']} predicted in full, "
                     f"{info['not_executable']} not executable here, "
                     f"{info['not_fitting']} not fitting memory"
                     + (f"; budget ran out, gap to lower bound {info['gap']:.1%}"
                        if info.get("timed_out") else "; exhaustive (branch and bound)"))
    tuned = any("measured_step_time" in r for r in ranked)
    rows = [("rank", "configuration", "step", *(("measured",) if tuned else ()), "samples/s",
             "bubble", "memory/device")]
    for r in ranked:
        rows.append((f"{r.get('rank', '?')}{' *' if r.get('chosen') else ''}", r["label"],
                     format_seconds(r["step_time"]), *((_measured(r),) if tuned else ()),
                     f"{r['samples_per_second']:.4g}", f"{r['bubble']:.1%}",
                     format_bytes(r["peak_memory"])))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines += table
    memory = _memory(records[0])
    if memory:
        lines.append(memory)
    ranks = _ranks(records[0])
    if ranks:
        lines.append(ranks)
    lines.append(_why(ranked, info))
    if tuned:
        lines.append(tuned_line(ranked))
    given = given_mesh_line(records[0])
    if given:
        lines.append(given)
    return "\n".join(lines)


def one_device_line(ranked: Sequence[dict[str, Any]], info: dict[str, Any]) -> str:
    """When the unpartitioned model on one device is predicted (or measured, after tuning)
    faster than the plan over all the devices: a sentence saying so, else empty."""
    alone = info.get("one_device")
    if not alone or not ranked:
        return ""
    winner = next((r for r in ranked if r.get("chosen")), ranked[0])
    devices = int(winner.get("config", {}).get("dp", 1) * winner.get("config", {}).get("tp", 1)
                  * winner.get("config", {}).get("pp", 1))
    measured, own = alone.get("measured_step_time"), winner.get("measured_step_time")
    if measured is not None and own is not None:
        if measured >= own:
            return ""
        how, mine, theirs = "measured", own, measured
    elif alone.get("fits", True) and alone["step_time"] < winner["step_time"]:
        how, mine, theirs = "predicted", winner["step_time"], alone["step_time"]
    else:
        return ""
    why = ("the devices share one host's cores" if str(alone["device"]).startswith("cpu")
           else "what the devices add does not pay for the plan's transfers and launches")
    return (f"the unpartitioned model on one device ({alone['device']}) is {how} faster than "
            f"this plan over {devices} devices: {format_seconds(theirs)} against "
            f"{format_seconds(mine)} per step; train it unpartitioned ({why}) unless it "
            "does not fit one device's memory.")


def tuned_line(ranked: Sequence[dict[str, Any]]) -> str:
    """What measured tuning found: the candidates timed, the fastest, and any that failed."""
    timed = [r for r in ranked if r.get("measured_step_time") is not None]
    failed = [r for r in ranked if r.get("tune_error")]
    text = f"tuned: timed {len(timed)} candidate{'s' * (len(timed) != 1)} on the example batch"
    if timed:
        best = min(timed, key=lambda r: r["measured_step_time"])
        first = min(ranked, key=lambda r: r.get("rank", 0))
        text += (f"; the measured fastest is {best['label']} at "
                 f"{format_seconds(best['measured_step_time'])} (predicted "
                 f"{format_seconds(best['step_time'])})")
        kept = next((r for r in timed if r.get("chosen")), best)
        if kept is not best:
            behind = kept["measured_step_time"] / best["measured_step_time"] - 1
            text += (f"; kept the better-ranked {kept['label']}, {behind:.1%} behind: too "
                     "close for the timing to tell apart")
        elif best is not first and first.get("measured_step_time") is not None:
            slower = first["measured_step_time"] / best["measured_step_time"] - 1
            text += (f"; the predicted best, {first['label']}, measured "
                     f"{format_seconds(first['measured_step_time'])} ({slower:.1%} slower)")
    for r in failed:
        text += f"; {r['label']} was skipped ({r['tune_error']})"
    return text + "."


def _measured(r: dict[str, Any]) -> str:
    if r.get("tune_error"):
        return "failed"
    value = r.get("measured_step_time")
    return format_seconds(value) if value is not None else "-"


def given_mesh_line(record: dict[str, Any]) -> str:
    """For a plan of a given mesh (``make_plan(mesh=...)``): its prediction against auto's
    best (``partitioner.planning.given_mesh``); empty for other plans."""
    mesh = record.get("given_mesh")
    if not mesh:
        return ""
    text = (f"given mesh dp={mesh['dp']} pp={mesh['pp']} tp={mesh['tp']}: {record['label']}, "
            f"predicted {format_seconds(record['step_time'])} per step; ")
    best = record.get("auto_best")
    if not best:
        return text + "auto's best: not found (no configuration fits without the mesh)."
    if best["label"] == record["label"]:
        return text + "auto's best is this configuration."
    ratio = record["step_time"] / best["step_time"] - 1
    text += (f"auto's best: {best['label']}, predicted {format_seconds(best['step_time'])} "
             f"({abs(ratio):.1%} {'faster' if ratio >= 0 else 'slower'})")
    if best.get("timed_out"):
        text += f"; the search's budget ran out {best['gap']:.1%} from its lower bound"
    return text + "."


def _memory(record: dict[str, Any]) -> str:
    """What each device's memory the plan may use, and the reserve it leaves."""
    capacity = record.get("capacity")
    if not capacity:
        return ""
    reserve = record.get("memory_reserve")
    if reserve is None:
        return f"memory: plans use at most {format_bytes(capacity)} per device."
    whole = capacity / (1 - reserve)
    return (f"memory: plans use at most {format_bytes(capacity)} of each device's "
            f"{format_bytes(whole)} (memory_reserve={reserve:g} left for the allocator and "
            "workspaces).")


def _why(ranked: Sequence[dict[str, Any]], info: dict[str, Any]) -> str:
    winner = next(r for r in ranked if r.get("chosen", r is ranked[0]))
    text = (f"chosen: {winner['label']}, predicted {format_seconds(winner['step_time'])} per step "
            f"({winner['samples_per_second']:.4g} samples/s, bubble {winner['bubble']:.1%}, "
            f"{format_bytes(winner['peak_memory'])} per device)")
    if winner.get("measured_step_time") is not None:
        text += f", measured {format_seconds(winner['measured_step_time'])}"
    if winner.get("ranked_step_time") is not None:
        text += f"; ranked at {format_seconds(winner['ranked_step_time'])} before it was built"
    others = [r for r in ranked if r is not winner]
    if others and winner.get("measured_step_time") is None:  # tuned: the tuned line says
        text += _against(winner, others[0])
    if _shares_host(winner) and winner["config"]["pp"] > 1:
        text += ("; the ranks are processes sharing this host's cores: a rank that waited "
                 "for its message starts cold, and each steps its own optimizer"
                 if (winner.get("cluster") or {}).get("processes") else
                 "; the devices share this machine's cores: each stage's worker keeps its "
                 "share of the threads, so a stage computing alone in the fill or drain runs "
                 "on its share")
    faster = [(label, why, bound) for label, why, bound in info.get("excluded", [])
              if bound < winner["step_time"]]
    if faster:
        label, why, bound = faster[0]
        count = info.get("excluded_faster", len(faster))
        text += (f"; {count} excluded configuration{'s' if count > 1 else ''} might be "
                 f"faster, e.g. {label} (bound {format_seconds(bound)}), but {why}")
    return text + "."


def _against(winner: dict[str, Any], rival: dict[str, Any]) -> str:
    """Why ``winner`` beat ``rival``: the part of the step that differs most."""
    slower = rival["step_time"] / winner["step_time"] - 1
    if slower < 5e-4:
        return (f"; the runner-up, {rival['label']}, is predicted as fast (within 0.05%): "
                "ties go to the fewest replicas, tensor ranks, stages and micro-batches, "
                "then the schedule's and checkpoint mode's order")
    parts = {"its bubble": (rival["bubble"] - winner["bubble"]) * rival["pipeline_time"],
             "more work per device": _work(rival) - _work(winner),
             "gradient all-reduce and optimizer": _after(rival) - _after(winner)}
    cause = max(parts, key=lambda k: parts[k])
    text = f"; the runner-up, {rival['label']}, is {slower:.1%} slower, mostly {cause}"
    if cause == "its bubble":
        text += f" ({rival['bubble']:.1%} against {winner['bubble']:.1%})"
    return text


def _ranks(record: dict[str, Any]) -> str:
    """What the processes of a ``torch.distributed`` world were costed on: how many, and the
    link between them (measured on one CPU host: ``partitioner.runtime.distributed.
    link_probe``)."""
    cluster = record.get("cluster") or {}
    if not cluster.get("processes"):
        return ""
    link = (cluster.get("intra_node") or {}).get("name", "?")
    count = cluster.get("nodes", 1) * cluster.get("devices_per_node", 1)
    return f"ranks: {count} processes, costed over {link}."


def _shares_host(record: dict[str, Any]) -> bool:
    cluster = record.get("cluster") or {}
    return bool(cluster.get("local")) and bool((cluster.get("device") or {}).get(
        "shared_speedup"))


def _work(r: dict[str, Any]) -> float:
    return r["pipeline_time"] * (1 - r["bubble"])


def _after(r: dict[str, Any]) -> float:
    return r["step_time"] - r["pipeline_time"]


def format_seconds(s: float) -> str:
    """Seconds as ``"12.3 ms"`` below a second, else ``"1.23 s"``."""
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def format_bytes(n: float) -> str:
    """Bytes in binary units, three significant digits, as memory is sold and reported.

    Example:
        >>> format_bytes(12.5 * 2**30), format_bytes(3 * 2**20), format_bytes(512)
        ('12.5 GiB', '3 MiB', '512 B')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
