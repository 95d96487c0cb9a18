"""A section-API script written against NVIDIA's client, switched by one import."""

import os
import time

import ftd_client.compat.nvrx as fault_tolerance

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
client = fault_tolerance.RankMonitorClient()
client.init_workload_monitoring(num_warmup_iters=2)
client.start_section("setup")
time.sleep(0.05)
client.end_section("setup")
for step in range(25):
    client.start_section("step")
    if attempt == 0 and rank == 0 and step == 6:
        time.sleep(3600)  # stuck inside a step
    if attempt == 1 and rank == 1 and step == 6:
        os.kill(os.getpid(), 9)  # a crash on the second attempt
    time.sleep(0.02)
    client.end_section("step")
client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False)
print(f"rank {rank} section timeouts {client.section_timeouts}", flush=True)
request = fault_tolerance.WorkloadControlRequest(fault_tolerance.WorkloadAction.Continue, "ok")
client.send_workload_control_request(request)
client.end_all_sections()
client.shutdown_workload_monitoring()
print(f"rank {rank} attempt {attempt} done", flush=True)
