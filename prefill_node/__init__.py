"""prefill_node package."""
