"""A plain script (no ftd import) that says whether ftd observes its progress: the sampler
thread at start, torch hooked once imported; it trains a few steps, then waits for the file
given as its argument (at most 60 s) and exits."""

from __future__ import annotations

import io
import os
import sys
import threading
import time


def main() -> None:
    release = sys.argv[1]
    names = {thread.name for thread in threading.enumerate()}
    print(f"progress thread {'ftd-progress' in names}", flush=True)
    import torch

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    torch.save(model.state_dict(), io.BytesIO())
    hooked = torch.save.__code__.co_filename.endswith("_progress_torch.py")
    print(f"torch hooked {hooked}", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
