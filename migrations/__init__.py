"""Alembic environment and numbered versions of the gateway's SQL schema.

Run through `gateway.migrate` (or `tiergate migrate`); no alembic.ini is needed.
"""
