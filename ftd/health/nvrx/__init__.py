"""NVIDIA Resiliency Extension's sockets served by ftd: wire format, the pickle decoder, the server
and its host."""
