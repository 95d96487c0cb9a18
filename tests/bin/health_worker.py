"""A rank that uses ftd_client and misbehaves on attempt 0 as its --mode says."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from ftd_client import RankClient, WorkloadAction

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--bad-rank", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--beats", type=int, default=10)
    args = parser.parse_args()
    client = RankClient()
    bad = ATTEMPT == 0 and args.bad_rank == RANK
    print(f"rank {RANK} attempt {ATTEMPT} up pid {os.getpid()}", flush=True)
    mode = args.mode

    if mode == "learn":
        for _ in range(args.beats):
            with client.section("step"):
                time.sleep(args.interval)
            client.heartbeat()
        learned = client.calculate_and_set_timeouts(out_of_section=False)
        print(f"rank {RANK} learned {json.dumps(learned)}", flush=True)
        print(f"rank {RANK} state {json.dumps(client.state_dict())}", flush=True)
        client.close()
        return
    if mode == "load-state" and RANK == 0:
        client.load_state_dict({"timeouts": {"rank_section_timeouts": {"step": 42.0}}})
        print(f"rank {RANK} loaded {json.dumps(client.timeouts)}", flush=True)
    if mode == "workload" and bad:
        ok = client.send_workload_control(WorkloadAction.SHUTDOWN_WORKLOAD, "cannot recover")
        print(f"rank {RANK} workload control acknowledged {ok}", flush=True)
        sys.exit(3)
    if mode == "relay":
        return beat_until_told(client, args)
    if mode == "gloo-hang":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        tensor = torch.ones(1)
        for step in range(args.beats):
            if bad and step == 3:  # silent before this step's heartbeat: the first to be late
                print(f"rank {RANK} hanging before allreduce", flush=True)
                time.sleep(3600)
            client.heartbeat()
            dist.all_reduce(tensor)
            time.sleep(args.interval)
        dist.destroy_process_group()
        print(f"rank {RANK} attempt {ATTEMPT} done", flush=True)
        return

    for beat in range(args.beats):
        if bad and beat == 3:
            print(f"rank {RANK} misbehaving: {mode}", flush=True)
            if mode == "stop-heartbeats":
                time.sleep(3600)
            elif mode == "stuck-in-step":
                client.start_section("step")
                time.sleep(3600)
            elif mode == "stuck-between":
                time.sleep(3600)
            elif mode == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)  # resumed by the daemon only to dump its stacks
            elif mode == "sigstop-then-die":  # dies as soon as it is resumed
                signal.signal(signal.SIGCONT, lambda *_: os._exit(7))
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)
        if mode == "no-first-heartbeat" and bad:
            time.sleep(3600)
        with client.section("step"):
            client.heartbeat()
            time.sleep(args.interval)
    client.close()
    print(f"rank {RANK} attempt {ATTEMPT} done", flush=True)


def beat_until_told(client: RankClient, args: argparse.Namespace) -> None:
    """Heartbeat until SIGUSR1, then go silent; rank 1 also starts the fuzz relay."""
    import subprocess
    from pathlib import Path

    told = []
    signal.signal(signal.SIGUSR1, lambda *_: told.append(True))
    if RANK == 1:
        relay = Path(os.environ["FTD_RUN_DIR"]) / "relay.sock"
        subprocess.Popen([sys.executable, str(Path(__file__).parent / "relay.py"), str(relay)])
    while not told:
        client.heartbeat()
        time.sleep(args.interval)
    print(f"rank {RANK} went silent", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
