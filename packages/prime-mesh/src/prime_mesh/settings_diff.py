"""Which settings differ between a node and the run it asks to join, for the line that refuses it.

A node may advertise a summary of its settings as `metadata["settings"]` (a flat
`{"section.key": "value"}` dict, values as short strings); the coordinator compares it with
the run's when the config hashes differ, so the refusal names the settings rather than two
hashes.
"""

from __future__ import annotations

from typing import Any

_SHOWN = 5  # differing settings named in the line (then "and N more")


def settings_differences(run: Any, mine: Any) -> str:
    """'; model.n_layers is 3 here, 2 in the run' for the settings that differ (empty when
    either side advertised none)."""
    if not isinstance(run, dict) or not isinstance(mine, dict):
        return ""
    keys = sorted(k for k in set(run) | set(mine) if run.get(k) != mine.get(k))
    if not keys:
        return ""
    shown = [
        f"{k} is {mine.get(k, '(unset)')} here, {run.get(k, '(unset)')} in the run"
        for k in keys[:_SHOWN]
    ]
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ": " + "; ".join(shown) + more
