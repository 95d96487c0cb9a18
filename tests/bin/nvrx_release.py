"""A rank written against NVIDIA's own client, unmodified, of the release first on PYTHONPATH
(tests/health/nvrx/releases.py: 0.5, 0.6 or 0.7 from its wheel).

Each iteration: a heartbeat, a "step" section, and a section not in rank_section_timeouts
(0.5 and later send nothing for it). Then, inside an untimed "finish" section: timeouts learned
for "step" (NVRx reduces its observations across ranks with torch.distributed), a Continue
request, and on the last attempt rank 0 asks to shut the workload down; every rank ends its
sections and its monitoring, and exits 0.

--hang-rank R: on attempt 0 rank R hangs inside its step at iteration --hang-at.
--slow-start S: on attempt 0, S seconds out of any section before the first step (NVRx 0.6's
monitor does not time that; 0.5's would).
--slow-step S: iteration 1's step takes S seconds longer.
--megatron: a stand-in for Megatron-LM's global args, whose iteration NVRx 0.6 reports.
"""

import argparse
import os
import sys
import time
import types

parser = argparse.ArgumentParser()
parser.add_argument("--iterations", type=int, default=400)
parser.add_argument("--hang-rank", type=int, default=-1)
parser.add_argument("--hang-at", type=int, default=50)
parser.add_argument("--slow-start", type=float, default=0.0)
parser.add_argument("--slow-step", type=float, default=0.0)
parser.add_argument("--megatron", action="store_true")
parser.add_argument("--last-attempt", type=int, default=0)
args = parser.parse_args()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])

megatron = types.SimpleNamespace(curr_iteration=0)
if args.megatron:  # what NVRx looks for (rank_monitor_client.py), as Megatron-LM sets it
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = megatron  # type: ignore[attr-defined]
    sys.modules["megatron.training.global_vars"] = global_vars

import nvidia_resiliency_ext  # noqa: E402
import nvidia_resiliency_ext.fault_tolerance as fault_tolerance  # noqa: E402
import torch.distributed as dist  # noqa: E402


def say(line: str) -> None:
    """One line in one write: the ranks share the daemon's stdout (a print is two writes, and
    two ranks' lines interleaved mid-line)."""
    os.write(1, (line + "\n").encode())


client = fault_tolerance.RankMonitorClient()
client.init_workload_monitoring()
say(
    f"rank {rank} attempt {attempt} release {nvidia_resiliency_ext.__version__} "
    f"from {fault_tolerance.__file__} "
    f"skip_section_response={getattr(client.cfg, 'skip_section_response', None)} "
    f"install_exception_hook={getattr(client.cfg, 'install_exception_hook', None)}"
)
if attempt == 0:
    time.sleep(args.slow_start)
for iteration in range(args.iterations):
    megatron.curr_iteration = iteration
    client.send_heartbeat()
    client.start_section("step")
    if attempt == 0 and rank == args.hang_rank and iteration == args.hang_at:
        say(f"rank {rank} hanging in step {iteration}")
        time.sleep(3600)
    if iteration == 1:
        time.sleep(args.slow_step)  # a slow warm-up step
    client.end_section("step")
    client.start_section("unconfigured")
    client.end_section("unconfigured")
say(f"rank {rank} attempt {attempt} iterations done")

client.start_section("finish")
dist.init_process_group("gloo")
client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False)
say(f"rank {rank} learned {client.section_timeouts}")
Request, Action = fault_tolerance.WorkloadControlRequest, fault_tolerance.WorkloadAction
client.send_workload_control_request(Request(Action.Continue, "still fine"))
if rank == 0 and attempt == args.last_attempt:
    client.send_workload_control_request(Request(Action.ShutdownWorkload, "done with this job"))
dist.barrier()
client.end_section("finish")
client.end_all_sections()
client.shutdown_workload_monitoring()
dist.destroy_process_group()
say(f"rank {rank} attempt {attempt} done")
