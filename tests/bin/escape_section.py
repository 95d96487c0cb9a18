"""A rank that opens a section whose name carries terminal escapes, says so, and waits."""

import time

from ftd_client import RankClient

NAME = "s\x1b[2J\r\x07\u202egnp"
client = RankClient()
client.start_section(NAME)
client.heartbeat()
print("section opened", flush=True)
time.sleep(120)
