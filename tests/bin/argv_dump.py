"""A rank that writes its arguments, as it received them, to $ARGV_OUT (JSON)."""

import json
import os
import sys
from pathlib import Path

out = Path(os.environ["ARGV_OUT"])
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps(sys.argv[1:]))
tmp.replace(out)
