"""Observability: Prometheus metrics and JSON stats, and the one log line per request. Both
listen to the cache's events (kvproxy.cache.reports.events) and read the slot pool when scraped."""
