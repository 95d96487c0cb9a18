"""Print, as JSON, the messages NVIDIA's client of each release given sends, pickled by that
release's own classes and pickler, and with protocol 5 (as a rank on Python 3.14 pickles
them): {version: {"4" or "5": {name: hex}}}. tests/health/nvrx/test_nvrx_release_protocol.py
compares them with its fixtures.

The releases are imported one after another in this one process (torch, which each imports,
once): each release's directory goes first on sys.path, and its modules are forgotten after.
"""

import argparse
import importlib
import inspect
import json
import pickle
import sys

parser = argparse.ArgumentParser()
parser.add_argument("paths", nargs="+", help="a release's directory (releases.py)")
args = parser.parse_args()


def messages() -> dict[str, object]:
    from nvidia_resiliency_ext.fault_tolerance import data

    since_0_6 = "iteration" in inspect.signature(data.SectionMsg).parameters
    later = {"iteration": 1201} if since_0_6 else {}
    info = data.RankInfo(global_rank=3, local_rank=1, host="node-1", pid=70000)
    if since_0_6:
        init = data.InitMsg(rank_info=info, iteration=1200, num_warmup_iters=3)
    else:  # as 0.5's client builds it
        init = data.InitMsg()
        init.rank_info = info
    Action = data.SectionAction
    # What the client sends at init with a loaded state, and after learning.
    loaded = data.SectionTimeouts({"step": 3.0}, None, {}, False)
    calculated = data.SectionTimeouts({"step": 3.0, "init": None}, 2.0, {"step"}, True)
    request = data.WorkloadControlRequest(data.WorkloadAction.ExcludeThisNode, "bad nic")
    found = {
        "authkey": data.AuthkeyMsg(b"k" * 32),
        "init": init,
        "heartbeat": data.HeartbeatMsg(3, {}),
        "section_open": data.SectionMsg(rank=0, section="step", action=Action.OPEN, **later),
        "section_close": data.SectionMsg(rank=2, section="step", action=Action.CLOSE, **later),
        "close_all": data.SectionMsg(rank=0, section=None, action=Action.CLOSE_ALL, **later),
        "update_config": data.UpdateConfigMsg(data.HeartbeatTimeouts(10.0, 5.0, True), calculated),
        "update_loaded": data.UpdateConfigMsg(None, loaded),
        "workload_request": (1, request),
    }
    if since_0_6:  # ft_launcher's own, to its monitor: the cycle
        found["launcher_cycle"] = data.UpdateConfigMsg(current_cycle=4)
    return found


printed: dict[str, dict[str, dict[str, str]]] = {}
for path in args.paths:
    sys.path.insert(0, path)
    importlib.invalidate_caches()
    import nvidia_resiliency_ext
    from nvidia_resiliency_ext.fault_tolerance.utils import _IPC_PICKLER

    assert nvidia_resiliency_ext.__file__.startswith(path), nvidia_resiliency_ext.__file__
    version = nvidia_resiliency_ext.__version__
    made = messages()
    printed[version] = {
        "4": {name: bytes(_IPC_PICKLER.dumps(m)).hex() for name, m in made.items()},
        "5": {name: pickle.dumps(m, protocol=5).hex() for name, m in made.items()},
    }
    for name in [name for name in sys.modules if name.startswith("nvidia_resiliency_ext")]:
        del sys.modules[name]
    sys.path.remove(path)
print(json.dumps(printed))
