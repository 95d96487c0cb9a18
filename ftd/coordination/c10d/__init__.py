"""The c10d TCPStore rendezvous backend."""
