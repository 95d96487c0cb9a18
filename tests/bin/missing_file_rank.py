"""A rank whose script opens a file that does not exist (issue 44 item 1): it says it is up,
waits for the file `<gate>.<attempt>` to exist, then dies of the FileNotFoundError, uncaught."""

import os
import sys
import time
from pathlib import Path

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
MISSING = "/nonexistent/ftd-issue-44/data.bin"

gate = Path(f"{sys.argv[1]}.{ATTEMPT}")
print(f"missing-file rank attempt {ATTEMPT} up", flush=True)
while not gate.exists():
    time.sleep(0.05)
open(MISSING)  # noqa: SIM115 (the failure under test)
