"""The percentiles the Python benchmarks report."""


def percentiles(samples):
    """p50, p99 and p999 of `samples` (nearest rank)."""
    s = sorted(samples)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return at(0.5), at(0.99), at(0.999)
