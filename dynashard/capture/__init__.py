"""Capture: the traced aten graph read as linears (match, its forms) and subclass inputs flattened."""
