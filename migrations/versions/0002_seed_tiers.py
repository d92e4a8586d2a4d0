"""Seed the three built-in tiers: priority, interactive, batch.

Defaults (admins change them through the admin API; later migrations never touch rows
an admin may have edited):

- priority: rank 0; SLO TTFT 500 ms, TPOT 50 ms; queue TTL 2 s; not preemptible;
  per tenant 600 rpm, 400k tpm, 32 concurrent; $1.00 / $3.00 per million in / out tokens.
- interactive: rank 1; SLO TTFT 2 s, TPOT 100 ms; queue TTL 10 s; min share 0.10;
  per tenant 300 rpm, 200k tpm, 16 concurrent; $0.50 / $1.50.
- batch: rank 2; no latency SLO; 24 h completion window; min share 0.05; preemptible;
  per tenant no rpm cap, 2M tpm, 64 concurrent; $0.25 / $0.75.

Batch is half the interactive price: it runs when the GPU would otherwise idle and may
be preempted. Its queue bound is the completion window, not a queue TTL.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SEEDED_TIERS = [
    {
        "name": "priority",
        "rank": 0,
        "ttft_slo_ms": 500.0,
        "tpot_slo_ms": 50.0,
        "max_queue_ms": 2_000.0,
        "completion_window_s": None,
        "min_share": 0.0,
        "preemptible": False,
        "rpm": 600,
        "tpm": 400_000,
        "max_concurrency": 32,
        "price_input_per_mtok": 1.00,
        "price_output_per_mtok": 3.00,
    },
    {
        "name": "interactive",
        "rank": 1,
        "ttft_slo_ms": 2_000.0,
        "tpot_slo_ms": 100.0,
        "max_queue_ms": 10_000.0,
        "completion_window_s": None,
        "min_share": 0.10,
        "preemptible": False,
        "rpm": 300,
        "tpm": 200_000,
        "max_concurrency": 16,
        "price_input_per_mtok": 0.50,
        "price_output_per_mtok": 1.50,
    },
    {
        "name": "batch",
        "rank": 2,
        "ttft_slo_ms": None,
        "tpot_slo_ms": None,
        "max_queue_ms": None,
        "completion_window_s": 86_400,
        "min_share": 0.05,
        "preemptible": True,
        "rpm": None,
        "tpm": 2_000_000,
        "max_concurrency": 64,
        "price_input_per_mtok": 0.25,
        "price_output_per_mtok": 0.75,
    },
]

_tiers = sa.table(
    "tiers",
    *(sa.column(name) for name in SEEDED_TIERS[0]),
)
_tenants = sa.table("tenants", sa.column("tier"))


def upgrade() -> None:
    # A downgrade past this revision keeps the seeded tiers tenants are on (as an admin
    # may have edited them); coming back up adds only the others.
    existing = set(op.get_bind().scalars(sa.select(_tiers.c.name)))
    missing = [tier for tier in SEEDED_TIERS if tier["name"] not in existing]
    if missing:
        op.bulk_insert(_tiers, missing)


def downgrade() -> None:
    # Only the seeded tiers no tenant is on: deleting one a tenant uses would fail on the
    # foreign key (every --demo database has such tenants), and dropping customers' tiers
    # must be a deliberate act, not a side effect of a downgrade. Going further down,
    # 0001 drops the tables anyway.
    op.execute(
        _tiers.delete().where(
            _tiers.c.name.in_([t["name"] for t in SEEDED_TIERS]),
            ~sa.exists().where(_tenants.c.tier == _tiers.c.name),
        )
    )
