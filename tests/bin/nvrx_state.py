"""ftd's NVRx-compatible client and NVRx's checkpoint layout: load the state in --load (as
NVRx's own client wrote it), print the timeouts in force, learn, and write state_dict() to
--save."""

import argparse
import json
import time
from pathlib import Path

import ftd_client.compat.nvrx as fault_tolerance

parser = argparse.ArgumentParser()
parser.add_argument("--load", type=Path, required=True)
parser.add_argument("--save", type=Path, required=True)
parser.add_argument("--learn", default="none", choices=["none", "empty-list", "all"])
args = parser.parse_args()

client = fault_tolerance.RankMonitorClient()
client.load_state_dict(json.loads(args.load.read_text()))
client.init_workload_monitoring()
print(f"loaded {json.dumps(client.state_dict(), sort_keys=True)}", flush=True)
for _ in range(3):
    client.send_heartbeat()
    client.start_section("init")
    time.sleep(0.01)
    client.end_section("init")
    client.start_section("step")
    time.sleep(0.01)
    client.end_section("step")
if args.learn == "empty-list":
    client.calculate_and_set_section_timeouts(selected_sections=[], calc_out_of_section=True)
elif args.learn == "all":
    client.calculate_and_set_section_timeouts()
print(f"sections {json.dumps(client.section_timeouts.section, sort_keys=True)}", flush=True)
args.save.write_text(json.dumps(client.state_dict(), sort_keys=True))
client.shutdown_workload_monitoring()
