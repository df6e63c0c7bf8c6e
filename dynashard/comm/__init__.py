"""Communication between ranks: the host-side protocol, out-of-graph transport, in-graph collectives."""
