"""The picture of one :mod:`bench.run` scenario: who is late, at a glance.

One PNG with two panels: the lateness CDF of each run (start − due, log x axis; a start
at or before due is drawn at 0.01 ms) and the tasks started per 100 ms over time (seconds
after the first due time). Needs matplotlib (the ``bench`` extra); imported only when
plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

FLOOR_MS = 0.01
COLOURS = {"ax": "tab:blue", "celery": "tab:green", "polling": "tab:orange"}
STYLES = ["-", "--", ":", "-."]


def plot(runs: Sequence[dict[str, Any]], title: str, path: Path) -> Path:
    """Draw ``runs`` (each with ``system``, ``repeat``, ``lateness_ms`` sorted and
    ``timeline``) into ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        style = {"color": COLOURS.get(run["system"]), "linewidth": 1.3,
                 "zorder": 3 if run["system"] == "ax" else 2,
                 "linestyle": STYLES[run["repeat"] % len(STYLES)],
                 "label": run["system"] + (f" #{run['repeat'] + 1}" if run["repeat"] else "")}
        late = [max(FLOOR_MS, v) for v in run["lateness_ms"]]
        if late:
            total = max(len(late), run.get("n", 0))  # tasks that never ran keep it below 1
            cdf.step(late, [(k + 1) / total for k in range(len(late))], where="post", **style)
        counts = run["timeline"]["counts"]
        start = run["timeline"]["start_s"]
        timeline.step([start + k * 0.1 for k in range(len(counts))], counts, where="post",
                      **style)
    cdf.set_xscale("log")
    cdf.set_xlabel(f"start − due (ms, log; at or before due: drawn at {FLOOR_MS})")
    cdf.set_ylabel("fraction of the tasks")
    cdf.set_title("lateness CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(loc="lower right")
    timeline.set_xlabel("seconds after the first due time")
    timeline.set_ylabel("tasks started per 100 ms")
    timeline.set_title("starts over time")
    timeline.axvline(0, color="grey", linewidth=0.8)
    timeline.grid(True, alpha=0.3)
    timeline.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
