"""A heartbeat-API script written against NVIDIA's client, switched by one import."""

import os
import sys
import time

import ftd_client.compat.nvrx as fault_tolerance

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
client = fault_tolerance.RankMonitorClient()
client.init_workload_monitoring()
print(f"rank {rank} hb timeouts {client.hb_timeouts}", flush=True)
for step in range(30):
    client.send_heartbeat()
    if attempt == 0 and rank == 1 and step == 5:
        time.sleep(3600)  # a hang: heartbeats stop
    if attempt == 1 and rank == 0 and step == 5:
        sys.exit(7)  # a crash on the second attempt
    time.sleep(0.02)
if client.calculate_and_set_hb_timeouts(skip_if_not_ready=True):
    print(f"rank {rank} calculated {client.hb_timeouts} valid={client.hb_timeouts.are_valid}")
state = client.state_dict()
client.load_state_dict(state)
client.shutdown_workload_monitoring()
print(f"rank {rank} attempt {attempt} done", flush=True)
