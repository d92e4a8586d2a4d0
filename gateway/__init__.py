"""HTTP gateway: auth, tenants and tiers in SQL, OpenAI-compatible API, admin API, CLI."""
