"""Training outside the graph: gradient norms, optimizer hooks, DTensor parameters for FSDP2."""
