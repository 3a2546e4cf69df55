"""Rows -> documents -> packs, epoch order, indexed datasets."""
