"""A rank written against NVIDIA's own client, unmodified: nvidia_resiliency_ext's
RankMonitorClient talks to `ftd serve` over NVRx's sockets and pickles.

Attempt 0: rank 1 hangs inside its "step" section at step 5 (the daemon must catch it).
Attempt 1: every rank trains, learns heartbeat and section timeouts (NVRx reduces its
observations across ranks with torch.distributed), saves its state_dict to --out, and rank 0
asks for the workload to be shut down, then fails: no restart may follow.
"""

import argparse
import json
import os
import time
from pathlib import Path

import nvidia_resiliency_ext.fault_tolerance as fault_tolerance
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])

dist.init_process_group("gloo")
client = fault_tolerance.RankMonitorClient()
client.init_workload_monitoring()
print(f"rank {rank} attempt {attempt} config {client.hb_timeouts} {client.section_timeouts}")
client.start_section("setup")
time.sleep(0.05)
client.end_section("setup")
for step in range(12):
    client.send_heartbeat()
    client.start_section("step")
    if attempt == 0 and rank == 1 and step == 5:
        print(f"rank {rank} hanging in step {step}", flush=True)
        time.sleep(3600)
    time.sleep(0.02)
    client.end_section("step")
    dist.barrier()
client.calculate_and_set_hb_timeouts()
client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=True)
args.out.mkdir(parents=True, exist_ok=True)
state = client.state_dict()
(args.out / f"state_r{rank}.json").write_text(json.dumps(state, default=sorted))
print(f"rank {rank} learned {client.hb_timeouts} {client.section_timeouts}", flush=True)
dist.barrier()
if rank == 0:
    request = fault_tolerance.WorkloadControlRequest(
        fault_tolerance.WorkloadAction.ShutdownWorkload, "done with this job"
    )
    client.send_workload_control_request(request)
    client.shutdown_workload_monitoring()
    raise SystemExit(3)
client.shutdown_workload_monitoring()
time.sleep(3600)  # stopped by the daemon once rank 0 failed
