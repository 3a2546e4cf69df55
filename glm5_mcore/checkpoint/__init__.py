"""Everything on disk."""
