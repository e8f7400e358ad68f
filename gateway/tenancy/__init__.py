"""Who is asking and how much they may ask: API keys (`auth`), the tenants file (`tenants`),
per-tenant token buckets (`rate_limit`) and each request's lease on its tenant's limits (`leases`).
Both front ends use it; it knows neither."""
