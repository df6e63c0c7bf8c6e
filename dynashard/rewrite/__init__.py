"""Rewrite: the interpreter that emits this rank's graph from the layout map, and its lowerings."""
