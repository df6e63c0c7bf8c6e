"""Capture: the traced aten graph read as linears (one record per form), its aliases, subclass inputs flattened."""
