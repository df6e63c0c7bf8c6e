"""Plan: a style per linear, layout propagation by rules, the re-cut fixpoint. Nothing here mutates a graph."""
