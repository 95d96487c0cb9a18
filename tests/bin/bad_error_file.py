"""A rank that leaves a hostile error file (TORCHELASTIC_ERROR_FILE) and exits 1.

--kind: empty, truncated, not_json, huge (10 MB), deep (nested 100 000 levels), odd (wrong
types), fifo (a named pipe), escapes (terminal escapes in the message).
"""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--kind", required=True)
parser.add_argument("--out", default="")
kind = parser.parse_args().kind
path = os.environ["TORCHELASTIC_ERROR_FILE"]
os.makedirs(os.path.dirname(path), exist_ok=True)
good = {
    "message": {
        "message": "RuntimeError: boom",
        "extraInfo": {"py_callstack": "Traceback ...\nRuntimeError: boom", "timestamp": "1"},
    }
}
if kind == "fifo":
    os.mkfifo(path)
else:
    contents = {
        "empty": "",
        "truncated": json.dumps(good)[:40],
        "not_json": "\x00\xff garbage {",
        "huge": "[" + "0," * (5 << 20) + "0]",
        "deep": "[" * 100_000 + "]" * 100_000,
        "odd": json.dumps({"message": {"message": 7, "extraInfo": [1, {"py_callstack": 2}]}}),
        "escapes": json.dumps({"message": "RuntimeError: \x1b[2J\x1b]0;pwned\x07 \u202egnp.exe"}),
    }[kind]
    with open(path, "w") as file:
        file.write(contents)
print(f"rank wrote a {kind} error file", file=sys.stderr, flush=True)
sys.exit(1)
