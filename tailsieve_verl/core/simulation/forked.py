"""Independent simulations side by side in forked processes: the policies of one run (``simulate
--jobs``), of every seed of a plan (``plan --jobs``). Each worker inherits the work and what it reads
through fork, so nothing but the results is pickled."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

_INHERITED: list = []  # the work of the running forked_map, read by its workers (inherited, not pickled)


def _call(index: int):
    return _INHERITED[0](index)


def forked_map(work: Callable[[int], T], count: int, jobs: int,
               done: Callable[[int], None] | None = None) -> list[T]:
    """``[work(0), ..., work(count - 1)]``, ``jobs`` forked processes at a time (in this process when
    ``jobs`` <= 1 or there is one item); ``done(k)`` after the k-th result arrives."""
    if jobs <= 1 or count <= 1:
        results = []
        for index in range(count):
            results.append(work(index))
            if done is not None:
                done(index + 1)
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    _INHERITED[:] = [work]
    try:
        with ProcessPoolExecutor(min(jobs, count), mp_context=multiprocessing.get_context("fork")) as workers:
            futures = {workers.submit(_call, index): index for index in range(count)}
            by_index: dict[int, T] = {}
            for k, future in enumerate(as_completed(futures), start=1):
                by_index[futures[future]] = future.result()
                if done is not None:
                    done(k)
    finally:
        _INHERITED.clear()
    return [by_index[index] for index in range(count)]
