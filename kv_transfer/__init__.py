"""kv_transfer package."""
