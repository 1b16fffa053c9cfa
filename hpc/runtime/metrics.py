"""Prometheus text exposition for workers and the frontend."""

from __future__ import annotations


def prometheus(prefix: str, values: dict[str, float], labels: dict[str, str]) -> bytes:
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines = []
    for name, value in sorted(values.items()):
        if not isinstance(value, (int, float)):
            continue
        metric = f"{prefix}_{name}"
        kind = "counter" if name.endswith("_total") or name in ("requests", "prompt_tokens", "generated_tokens") \
            else "gauge"
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric}{{{label}}} {value}")
    return ("\n".join(lines) + "\n").encode()
