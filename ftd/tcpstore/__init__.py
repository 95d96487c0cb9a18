"""c10d's TCPStore protocol served without torch: `TcpStoreServer` (server.py), its bounded
decoder (wire.py) and the store's semantics with its budget (state.py)."""
