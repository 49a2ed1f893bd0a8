"""Parse a Prometheus text exposition into {(sample name, sorted labels): value} for exact assertions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The one sample called `name` whose labels include `labels` (summed if several match)."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert hits, f"no sample {name} {labels}"
    return sum(hits)


def value_or_zero(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
