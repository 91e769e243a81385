"""Pool router: verl's router plugin (``router_config_path`` → ``router_class``) for TailSieve.

Replicas are split into a tail pool and a bulk pool **by server address** (the trainer sends the
split each step, so pools can be re-assigned when the controller moves m). Inside each pool the
routing is verl's own: one ``GlobalRequestLoadBalancer`` per pool (sticky by key, else the
least-in-flight server, ties at random), so a TailSieve pool routes exactly like stock verl routes
the whole cluster — every sample to the least-loaded replica of its pool, a group's samples spread
over the pool. With ``group_atomic`` (the paper's setting, or prefix-cache-heavy prompts) the
sticky key is the group instead of the request, so all n samples of a group (and every turn)
share the replica its first request got. Under verl's ``rollout.full_determinism`` each pool's
balancer routes as stock verl's does then: by a hash of the agent loop's own request id (the group
key with ``group_atomic``: a fresh uid per dispatch, so not the same replica across runs). Nothing
here assumes a shared host — addresses and Ray
actor handles work across the nodes of a Ray cluster.

Requests carry their group in the request id (``ts:<group uid>:<nonce>``, written by
:class:`tailsieve_verl.integration.agent_loop.GroupTaggedClient`); requests without it (e.g.
validation) go to the least-loaded server of either pool, like verl's default router.

The router also keeps the step's ledger of per-sample measurements reported by the agent loops
(durations measured on the worker's own clock, so no cross-host clock is compared).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from tailsieve_verl.core.kinds import Pool

logger = logging.getLogger(__name__)

REQUEST_PREFIX = "ts"


def tag_request_id(group_uid: str, nonce: str) -> str:
    return f"{REQUEST_PREFIX}:{group_uid}:{nonce}"


def group_of_request(request_id: str) -> str | None:
    """The group uid a request id carries (servers may see it with a suffix added: ``ts:<uid>:<rest>``)."""
    parts = str(request_id).split(":", 2)
    return parts[1] if len(parts) == 3 and parts[0] == REQUEST_PREFIX else None


def callers_request_id(request_id: str) -> str:
    """The id the agent loop gave the request, before the group tag (verl's ``det-<priority>`` under
    ``rollout.full_determinism``): stable across runs, unlike the group uid."""
    return str(request_id).split(":", 2)[2] if group_of_request(request_id) is not None else str(request_id)


class AbortedGroups:
    """The groups a server was told to abort, so that their later requests (a next turn, a sample not
    sent yet) come back aborted at once. Bounded: group uids are fresh per dispatch attempt, and the
    oldest are forgotten long after their step ended."""

    def __init__(self, capacity: int = 65536):
        self._uids: dict[str, None] = {}
        self._capacity = capacity

    def add(self, uids: list[str]) -> set[str]:
        for uid in uids:
            self._uids[str(uid)] = None
        while len(self._uids) > self._capacity:
            del self._uids[next(iter(self._uids))]
        return {str(uid) for uid in uids}

    def __contains__(self, uid: object) -> bool:
        return uid in self._uids


@dataclass(frozen=True)
class GroupReport:
    """One group as its agent loops measured it (each sample on its worker's monotonic clock)."""

    uid: str
    duration_s: float  # agent-loop start → last sample settled (the group's finish time in its pool)
    tokens: tuple[int, ...]  # each sample's work, by session id (core.tailsieve.selector.group_work: generated tokens)
    sample_aborted: tuple[bool, ...]  # each sample: cut by the abort (its work is a lower bound on its length)
    aborted: bool
    failed: bool

    @classmethod
    def from_samples(cls, uid: str, samples: dict[int, dict]) -> "GroupReport":
        ordered = [samples[k] for k in sorted(samples)]
        cut = tuple(bool(s["aborted"]) for s in ordered)
        return cls(uid, max(s["duration_s"] for s in ordered), tuple(int(s["tokens"]) for s in ordered), cut,
                   any(cut), any(s["failed"] for s in ordered))


class PoolRouter:
    """Pool-aware router over one verl balancer per pool (a plain class; verl wraps it with ``ray.remote``)."""

    def __init__(self, servers: dict[str, Any], yaml_config: dict | None = None):
        self._servers: dict[str, Any] = dict(servers)
        self._pool_of: dict[str, Pool] = {address: Pool.BULK for address in servers}
        # imported here, not at module level: verl's plugin loader imports this module from inside
        # `import verl`, before verl's rollout package can be imported
        from verl.workers.rollout.router import GlobalRequestLoadBalancer

        self._balancer_cls = GlobalRequestLoadBalancer
        self.full_determinism = False
        self._balancers = self._new_balancers()
        self.group_atomic = False
        self._group_pool: dict[str, Pool] = {}
        self._group_servers: dict[str, set[str]] = {}
        self._samples: dict[str, dict[int, dict]] = {}
        self._progress: dict[str, dict[int, int]] = {}  # group -> session -> work after its last finished turn

    # ---- trainer-side control ------------------------------------------------------------------
    def _new_balancers(self) -> dict:
        """One verl balancer per pool over the servers the pools hold (none in flight: between steps)."""
        return {pool: self._balancer_cls({a: h for a, h in self._servers.items() if self._pool_of[a] == pool},
                                         full_determinism=self.full_determinism) for pool in (Pool.TAIL, Pool.BULK)}

    def set_pools(self, tail_addresses: list[str], group_atomic: bool | None = None,
                  full_determinism: bool | None = None) -> dict[str, list[str]]:
        """Make ``tail_addresses`` the tail pool and every other live replica the bulk pool (between
        steps: a server moved to the other pool starts there with no request in flight).
        ``full_determinism`` (verl's ``rollout.full_determinism``): each pool routes a request by a hash
        of the agent loop's own request id, as stock verl's balancer routes over the whole cluster."""
        unknown = set(tail_addresses) - set(self._servers)
        if unknown:
            raise ValueError(f"unknown replica addresses {sorted(unknown)}; live: {sorted(self._servers)}")
        if group_atomic is not None:
            self.group_atomic = bool(group_atomic)
        if full_determinism is not None and bool(full_determinism) != self.full_determinism:
            self.full_determinism = bool(full_determinism)
            self._balancers = self._new_balancers()
        tail = set(tail_addresses)
        for address in self._servers:
            pool = Pool.TAIL if address in tail else Pool.BULK
            if self._pool_of.get(address) != pool:
                self._balancers[self._pool_of[address]].remove_servers([address])
                self._balancers[pool].add_servers({address: self._servers[address]})
                self._pool_of[address] = pool
        return self.pools()

    def pools(self) -> dict[Pool, list[str]]:
        return {pool: [a for a in self._servers if self._pool_of.get(a) == pool] for pool in (Pool.TAIL, Pool.BULK)}

    def assign_groups(self, group_pools: dict[str, str]) -> None:
        """Declare the pool of each group of the coming dispatch (a :class:`Pool` or its string)."""
        for uid, pool in group_pools.items():
            if pool not in tuple(Pool):
                raise ValueError(f"unknown pool {pool!r} for group {uid}")
            self._group_pool[uid] = Pool(pool)
            self._group_servers.pop(uid, None)

    def forget_groups(self, uids: list[str]) -> None:
        for uid in uids:
            self._group_pool.pop(uid, None)
            self._group_servers.pop(uid, None)
            self._samples.pop(uid, None)
            self._progress.pop(uid, None)

    def group_servers(self, uids: list[str]) -> dict[str, list[str]]:
        """Every server that ran a request of each group (several when samples are spread)."""
        return {uid: sorted(self._group_servers[uid]) for uid in uids if uid in self._group_servers}

    def report_sample(self, sample: dict) -> None:
        """Keep a sample's report for the trainer; reports of groups it did not dispatch (validation,
        whose rows run through the wrapper too) are not the step's and are dropped."""
        uid = str(sample["uid"])
        if uid in self._group_pool:
            self._samples.setdefault(uid, {})[int(sample["session_id"])] = dict(sample)

    def take_reports(self, expected: dict[str, int]) -> dict[str, dict]:
        """Reports of the groups in ``expected`` (group uid -> its number of samples, verl's per-row
        ``__rollout_n__`` or ``rollout.n``) whose every sample has reported; removed once taken."""
        ready = [uid for uid, n in expected.items() if len(self._samples.get(uid, {})) >= n]
        for uid in ready:
            self._progress.pop(uid, None)
        return {uid: asdict(GroupReport.from_samples(uid, self._samples.pop(uid))) for uid in ready}

    def report_progress(self, uid: str, session_id: int, tokens: int) -> None:
        """A sample's work after each turn it finished: what it has generated should the abort find it
        between turns (in a tool call the abort cannot interrupt, reporting only once that ends)."""
        if uid in self._group_pool:
            self._progress.setdefault(uid, {})[int(session_id)] = int(tokens)

    def take_partial_reports(self, uids: list[str]) -> dict[str, dict]:
        """Reports of these groups (aborted, still settling when their step closed) from what their
        samples have reported so far: a sample still in its agent loop counts the work of its finished
        turns, as cut by the abort (its tokens generated by the abort); removed once taken."""
        reports = {}
        for uid in uids:
            samples = self._samples.pop(uid, {})
            for session, tokens in self._progress.pop(uid, {}).items():
                samples.setdefault(session, {"duration_s": 0.0, "tokens": tokens, "aborted": True, "failed": False})
            if samples:
                reports[uid] = asdict(GroupReport.from_samples(uid, samples))
        return reports

    def refusals(self, uids: list[str]) -> dict[str, dict]:
        """For each of ``uids`` with reports: how many samples reported, and the engine's reason if it
        refused one of them (left in the ledger)."""
        out = {}
        for uid in uids:
            samples = self._samples.get(uid, {}).values()
            if samples:
                out[uid] = {"reported": len(samples), "refused": next((s["refused"] for s in samples if s.get("refused")), None)}
        return out

    # ---- verl RequestLoadBalancer protocol -----------------------------------------------------
    def acquire_server(self, request_id: str, **_: Any) -> tuple[str, Any]:
        if not self._servers:
            raise RuntimeError("No available servers in load balancer")
        uid = group_of_request(request_id)
        pool = self._group_pool.get(uid, Pool.ANY) if uid is not None else Pool.ANY
        balancer = self._balancer_for(pool)
        key = (uid if uid is not None and self.group_atomic
               else callers_request_id(request_id) if self.full_determinism else str(request_id))
        address, handle = balancer.acquire_server(key)
        if uid in self._group_pool:
            self._group_servers.setdefault(uid, set()).add(address)
        return address, handle

    def _balancer_for(self, pool: Pool):
        """The pool's balancer; ANY (and a pool that lost its last replica) takes the less loaded one."""
        live = {p: b for p, b in self._balancers.items() if b.get_all_servers()}
        if pool in live:
            return live[pool]
        return min(live.values(), key=lambda b: min(b.get_inflight_count(a) for a in b.get_all_servers()))

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        pool = self._pool_of.get(server_id)
        if pool is not None:
            self._balancers[pool].release_server(server_id, request_id)

    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def add_servers(self, servers: dict[str, Any]) -> None:
        for address, handle in servers.items():
            self._servers[address] = handle
            if address not in self._pool_of:
                self._pool_of[address] = Pool.BULK
                self._balancers[Pool.BULK].add_servers({address: handle})

    def remove_servers(self, server_ids: list[str]) -> None:
        for address in server_ids:
            self._servers.pop(address, None)
            pool = self._pool_of.pop(address, None)
            if pool is not None:
                self._balancers[pool].remove_servers([address])
        logger.warning("[PoolRouter] removed replicas %s", server_ids)

    def get_all_servers(self) -> list[str]:
        return list(self._servers)

    def get_inflight_count(self, server_id: str) -> int:
        pool = self._pool_of.get(server_id)
        return self._balancers[pool].get_inflight_count(server_id) if pool is not None else 0

    def get_status(self) -> dict:
        loads = {address: self.get_inflight_count(address) for address in self._servers}
        return {"servers": loads, "total_inflight": sum(loads.values()), "active_servers": len(self._servers),
                "pools": self.pools(), "group_atomic": self.group_atomic, "full_determinism": self.full_determinism}

    def clear_sticky_cache(self) -> dict:
        """Stickiness keys are fresh per dispatch attempt (request ids, group uids), so nothing to clear."""
        return {"cleared_entries": 0, "server_loads": {a: self.get_inflight_count(a) for a in self._servers}}

    def get_total_inflight(self) -> int:
        return sum(self.get_inflight_count(a) for a in self._servers)
