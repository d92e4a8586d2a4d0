"""Every Redis key the scheduler uses, in one place.

All keys start with a configurable prefix so that tests and deployments can share one
Redis server. Keep a hash tag in the prefix (the default `{tiergate}:`) so that every key
of one deployment lands in the same Redis Cluster slot, which the Lua scripts need: they
derive per-tier and per-tenant key names at run time from the prefix.

Families (after the prefix):
- `seq`                   string, arrival counter (orders jobs within a tenant)
- `tiers`                 hash, tier name -> JSON of its TierConfig (read by get_tiers)
- `tier_policy`           hash, the same table in the form the scripts read without
                          decoding JSON: `rank:<tier>`, `min_share:<tier>` and (when set)
                          `max_queued:<tier>` -> number; written with `tiers`, atomically
- `depth`                 hash, tier -> number of queued jobs (fields at 0 are removed)
- `job:<id>`              hash, one job's record; expires after it finishes
- `tq:<tier>:<tenant>`    sorted set, the tenant's queued job ids scored by arrival seq
- `active:<tier>`         sorted set, backlogged tenants scored by virtual token counter
- `vtc:<tier>`            hash, tenant -> virtual token counter (kept while idle)
- `floor`                 hash, tier -> counter of the tenant served last
- `weights`               hash, tenant -> its current fair-share weight, which every
                          charge divides by; set by each enqueue and by
                          set_tenant_weight, kept while the tenant has jobs
- `live_jobs`             hash, tenant -> number of its queued and leased jobs (a field
                          at 0 is removed, and the tenant's `weights` field with it)
- `qprefill:<tier>`       hash, tenant -> queued prompt tokens
- `qdecode:<tier>`        hash, tenant -> queued max_tokens
- `share:<tier>`          hash, window bucket -> tokens served to the tier
- `share_total`           hash, window bucket -> tokens served to all tiers
- `expiries`              sorted set, queued job id -> ms when it times out
- `deadlines`             sorted set, queued job id -> batch deadline ms
- `leases`                sorted set, leased job id -> ms when its lease ends
- `res:<id>`              stream, one request's result events; expires after the last
- `workers`               sorted set, worker id -> ms until its capacity report lapses
- `cap:<worker>`          hash, a worker's measured prefill and decode tokens/s, the
                          work its engine holds per rank (JSON fields) and its free
                          sequence slots (`num_free_seqs`: less the jobs leased since
                          it reported, plus those of them that ended, marked `sl` in
                          their job hash), the slot releases it expects, its running
                          preemptible and its waiting sequences per rank
                          (scheduler.slot_release; admission ages the releases by
                          `reported_at_ms`); for operators also its running and waiting
                          sequences, KV-cache use and when it reported
- `seated:<worker>`      hash, rank -> decode tokens (max_tokens) of the jobs leased into
                          the worker's free slots since its last report (`rs`, a count
                          in its cap hash, marks the report: `sr` in their job hash), and
                          running: admission counts them held until the next report
- `rl:<tenant>`           hash, a tenant's RPM and TPM bucket levels
- `rl_inflight:<tenant>`  sorted set, reservation id -> ms when it lapses (concurrency)
- `gateway:<gateway>`     string, a gateway's presence: `up` while it renews it (a TTL of
                          a few seconds); once that lapses, the ms when a queue script
                          first found it gone (see owner_gone in lua/_lib.lua)
- `unbilled:<gateway>`    set, ids of the jobs a gateway queued with a billed prompt
                          (Job.bill_prompt_tokens) whose usage it has not written yet
                          (it settles them after each write); another gateway bills
                          them once it has gone (claim_unbilled.lua), which empties it
- `billing`               set, the gateways that may have an `unbilled` set (a gone one
                          leaves once its set is empty)
- `totals`                hash, counts since the queue began, for operators:
                          `lease_expirations`, `requeues`, `abandoned` (QueueTotals)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_PREFIX = "{tiergate}:"

# Family name -> suffix after the prefix. Lua scripts receive the same table (LUA_KEY_TABLE).
FAMILIES: dict[str, str] = {
    "seq": "seq",
    "tiers": "tiers",
    "tier_policy": "tier_policy",
    "depth": "depth",
    "job": "job:",
    "tq": "tq:",
    "active": "active:",
    "vtc": "vtc:",
    "floor": "floor",
    "weights": "weights",
    "live_jobs": "live_jobs",
    "qprefill": "qprefill:",
    "qdecode": "qdecode:",
    "share": "share:",
    "share_total": "share_total",
    "expiries": "expiries",
    "deadlines": "deadlines",
    "leases": "leases",
    "res": "res:",
    "workers": "workers",
    "cap": "cap:",
    "seated": "seated:",
    "rl": "rl:",
    "rl_inflight": "rl_inflight:",
    "gateway": "gateway:",
    "unbilled": "unbilled:",
    "billing": "billing",
    "totals": "totals",
}


def lua_key_table(families: Iterable[str] | None = None) -> str:
    """Lua code defining `K`, the key names built from the prefix passed as ARGV[1].

    It is prepended to every script, so the names live here and nowhere else. Building
    the table runs on every call, so a script gets only the `families` it uses (all of
    them when None).
    """
    wanted = FAMILIES if families is None else {f: FAMILIES[f] for f in sorted(set(families))}
    entries = ", ".join(f"{name} = P .. '{suffix}'" for name, suffix in wanted.items())
    return f"local P = ARGV[1]\nlocal K = {{{entries}}}\n"


@dataclass(frozen=True)
class KeySpace:
    """Key names under one prefix, for the Python side of the Redis backends."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix:
            raise ValueError("the key prefix must not be empty")

    def _key(self, family: str, suffix: str = "") -> str:
        return self.prefix + FAMILIES[family] + suffix

    @property
    def tiers(self) -> str:
        return self._key("tiers")

    @property
    def tier_policy(self) -> str:
        return self._key("tier_policy")

    @property
    def depth(self) -> str:
        return self._key("depth")

    @property
    def workers(self) -> str:
        return self._key("workers")

    @property
    def weights(self) -> str:
        return self._key("weights")

    @property
    def live_jobs(self) -> str:
        return self._key("live_jobs")

    @property
    def totals(self) -> str:
        return self._key("totals")

    def job(self, job_id: str) -> str:
        return self._key("job", job_id)

    def tenant_queue(self, tier: str, tenant_id: str) -> str:
        return self._key("tq", f"{tier}:{tenant_id}")

    def active(self, tier: str) -> str:
        return self._key("active", tier)

    def counters(self, tier: str) -> str:
        return self._key("vtc", tier)

    def queued_prefill(self, tier: str) -> str:
        return self._key("qprefill", tier)

    def queued_decode(self, tier: str) -> str:
        return self._key("qdecode", tier)

    def share(self, tier: str) -> str:
        return self._key("share", tier)

    @property
    def floor(self) -> str:
        return self._key("floor")

    def results(self, job_id: str) -> str:
        return self._key("res", job_id)

    def capacity(self, worker_id: str) -> str:
        return self._key("cap", worker_id)

    def seated(self, worker_id: str) -> str:
        return self._key("seated", worker_id)

    def rate_buckets(self, tenant_id: str) -> str:
        return self._key("rl", tenant_id)

    def rate_inflight(self, tenant_id: str) -> str:
        return self._key("rl_inflight", tenant_id)

    def gateway(self, gateway_id: str) -> str:
        return self._key("gateway", gateway_id)

    def unbilled(self, gateway_id: str) -> str:
        return self._key("unbilled", gateway_id)

    @property
    def billing(self) -> str:
        return self._key("billing")

    def pattern(self) -> str:
        """A SCAN pattern matching every key of this prefix (for cleanup in tests)."""
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix)
        return escaped + "*"
