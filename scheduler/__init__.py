"""Tier policy, fair share between tenants, admission control and the shared queue."""
