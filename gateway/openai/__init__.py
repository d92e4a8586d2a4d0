"""The OpenAI-compatible API: request schemas, response shapes, routes."""
