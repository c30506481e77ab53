"""Helpers shared by the JAX-side benchmark scripts (bench_*.py)."""
import statistics
import time


def median_time(fn, runs):
    """Median wall time of `runs` calls of `fn`, in seconds (this machine is noisy)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
