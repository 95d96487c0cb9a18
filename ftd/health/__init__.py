"""Rank health: the ranks' socket, the monitor and its deadlines, hangs, learned timeouts, NVRx's
sockets (nvrx/)."""
