"""decode_node package."""
