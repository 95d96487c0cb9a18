"""Says whether torch._dynamo was imported before the script ran; attempt 0 then waits for
<out>/go and fails, so that the next attempt is forked from the same zygote."""

import json
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out.mkdir(parents=True, exist_ok=True)
(out / f"dynamo_a{attempt}.json").write_text(json.dumps("torch._dynamo" in sys.modules))
if attempt == 0:
    while not (out / "go").exists():
        time.sleep(0.05)
    sys.exit(1)
