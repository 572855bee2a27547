"""The run's books (docs/RELIABILITY.md §1): every trajectory group counted at each stage, and a check they balance.

Evidence, from three independent sources:
- each rollout server's own counters, reported in every heartbeat and its bye and written to
  `logs/books/<server_id>.json` when it exits cleanly: generated, sent, bad_groups (refused by the wire
  codec before sending) and unsent (scored or scoring, not yet handed to the socket);
- the learner's wire tally per (server, session): messages accepted and the highest sequence number
  seen (qurl.wire.protocol stamps every message with a per-socket sequence number, so a missing number is
  a specific group that never arrived);
- the learner's buffer counters: received, used, dropped (stale, filter, invalid = rejected, restart)
  and the groups still buffered. The learner checkpoints its ledger, so a resume keeps the books.

`close` derives each named category from that evidence and `problems` lists every way they fail to
balance; the identity checked is

    generated = used + dropped_stale + dropped_filter + rejected + buffered_at_end
                + dropped_at_restart + bad_groups + unsent_at_exit + lost_in_transit
                + lost_at_learner_restart + undelivered_at_end
"""

from __future__ import annotations

import json
import os
from typing import Any

LEDGER = "ledger.json"  # in the run folder, written by the learner at each checkpoint and at the end
EXIT_REPORTS = os.path.join("logs", "books")  # in the run folder, one file per cleanly exited server
REPORT_KEYS = ("generated", "sent", "bad_groups", "unsent")
CATEGORIES = (
    "used",
    "dropped_stale",
    "dropped_filter",
    "rejected",
    "buffered_at_end",
    "dropped_at_restart",
    "bad_groups",
    "unsent_at_exit",
    "lost_in_transit",
    "lost_at_learner_restart",
    "undelivered_at_end",
)


def report(counters: dict, *, final: bool, life: int = 0) -> dict:
    """A server's book counters out of its heartbeat (final: from its bye or exit file)."""
    return {**{k: int(counters.get(k, 0)) for k in REPORT_KEYS}, "final": final, "life": life}


def write_exit_report(folder: str, server_id: str, counters: dict) -> None:
    """The server's final counters, written atomically at a clean exit: evidence that outlives the learner."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{server_id}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report(counters, final=True), f)
    os.replace(tmp, os.path.join(folder, f"{server_id}.json"))


def read_exit_reports(folder: str) -> dict[str, dict]:
    """server id -> final report, from every exit file under folder."""
    out = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json") and not name.startswith("."):
                with open(os.path.join(folder, name)) as f:
                    out[name[: -len(".json")]] = json.load(f)
    return out


def write_ledger(run_dir: str, ledger: dict) -> None:
    """The learner's side of the books ({"buffer": TrajectoryBuffer.counters(), "reports": ...}), atomically."""
    tmp = os.path.join(run_dir, ".ledger.json.tmp")
    with open(tmp, "w") as f:
        json.dump(ledger, f)
    os.replace(tmp, os.path.join(run_dir, LEDGER))


def close_run(run_dir: str, learner_ended_cleanly: bool) -> dict[str, Any]:
    """`close` over the run folder's ledger.json and the servers' exit reports under logs/books/."""
    path = os.path.join(run_dir, LEDGER)
    ledger = {}
    if os.path.exists(path):
        with open(path) as f:
            ledger = json.load(f)
    return close(ledger, read_exit_reports(os.path.join(run_dir, EXIT_REPORTS)), learner_ended_cleanly)


def close(ledger: dict, exits: dict[str, dict], learner_ended_cleanly: bool) -> dict[str, Any]:
    """Stage totals, named categories and the problems found (empty when the books balance)."""
    buf = ledger.get("buffer", {})
    dropped = buf.get("dropped", {})
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update(
        used=buf.get("used", 0),
        dropped_stale=dropped.get("stale", 0),
        dropped_filter=dropped.get("filter", 0),
        rejected=dropped.get("invalid", 0),
        buffered_at_end=buf.get("buffered", 0),
        dropped_at_restart=dropped.get("restart", 0),
    )
    life = buf.get("life", 1)
    restarted = life > 1 or not learner_ended_cleanly
    problems: list[str] = []
    generated = sent = wire_received = 0
    wires, reports = buf.get("wire", {}), ledger.get("reports", {})
    used_from = buf.get("used_from", {})
    per_server: dict[str, dict[str, int]] = {}
    for sid in sorted(set(wires) | set(reports) | set(exits)):
        rep = exits.get(sid) or reports.get(sid) or report({}, final=False)
        tallies = wires.get(sid, {}).get("sessions", {}).values()
        n = sum(count for count, _ in tallies)
        top = sum(high + 1 for _, high in tallies)  # seq numbers 0..high were sent on each session
        crash_gaps = wires.get(sid, {}).get("restart_gaps", 0)
        g, s, b, q = (rep[k] for k in REPORT_KEYS)
        if g != s + b + q:
            problems.append(f"{sid}: generated {g} != sent {s} + bad_groups {b} + unsent {q} (server's own counters)")
        if n > top:
            problems.append(f"{sid}: {n} groups received but sequence numbers show only {top} sent (counted twice)")
        late = max(0, top - s)  # sent after its last report: evidence from the sequence numbers
        if rep["final"] and late:
            problems.append(f"{sid}: sequence numbers show {top} sent, more than its final count {s}")
        cats["bad_groups"] += b
        cats["unsent_at_exit"] += q - min(late, q)
        gaps = top - n
        cats["lost_in_transit"] += gaps - crash_gaps
        tail = s + late - top  # sent, never received: the learner stopped or died first
        last_seen = wires.get(sid, {}).get("life", rep.get("life", 0))  # the learner life that last heard of it
        to_ended_life = restarted and (last_seen < life or not learner_ended_cleanly)
        cats["lost_at_learner_restart"] += crash_gaps + (tail if to_ended_life else 0)
        cats["undelivered_at_end"] += 0 if to_ended_life else tail
        generated += g + max(0, late - q)
        sent += s + late
        wire_received += n
        per_server[sid] = {
            "generated": g + max(0, late - q),
            "sent": s + late,
            "received": n,
            "used": used_from.get(sid, 0),
        }
    received = buf.get("received", 0)
    if received != wire_received:
        problems.append(f"learner counted {received} groups received, its wire tally {wire_received}")
    learner_side = sum(cats[k] for k in CATEGORIES[:6])
    if received != learner_side:
        problems.append(
            f"received {received} != used + dropped + rejected + buffered + dropped_at_restart {learner_side}"
        )
    if generated != sum(cats.values()):
        problems.append(f"generated {generated} != the sum of the categories {sum(cats.values())}")
    problems += [f"{k} is negative ({v})" for k, v in cats.items() if v < 0]
    return {
        "generated": generated,
        "sent": sent,
        "received": received,
        **cats,
        "balanced": not problems,
        "problems": problems,
        "servers": per_server,
    }
