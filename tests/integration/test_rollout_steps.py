"""TailSieve on verl 0.9.1's own V1 rollout path, with simulated replicas, for several steps."""

from __future__ import annotations

from collections import Counter

B, N = 8, 2


def test_uniform_mode_is_uniform_group_routing(harness_factory):
    h = harness_factory(["+tailsieve.enable=false"])
    seen: list[str] = []
    for _ in range(2):
        result = h.step()
        m = result["metrics"]
        assert m["tailsieve/q"] == 0 and m["tailsieve/m"] == 0 and m["tailsieve/aborted_groups"] == 0
        assert len(result["batch"].keys) == B * N
        counts = Counter(result["prompt_ids"])
        assert len(counts) == B and set(counts.values()) == {N}
        seen += list(counts)
    assert len(set(seen)) == len(seen)  # every prompt consumed once
    stats = h.server_stats()
    # round-robin whole groups over the 4 replicas: 2 steps x 8 groups x 2 samples / 4 replicas
    assert [s["completed"] for s in stats] == [2 * B * N // 4] * 4
    assert sum(s["aborted"] for s in stats) == 0
