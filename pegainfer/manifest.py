"""The run directory's manifest: every process and socket of one instance, so that a person
(or `pegainfer tap`) can find and attach to them."""

from __future__ import annotations

import json
import os
import subprocess
import time

from pegainfer import ipc
from pegainfer.config import EngineConfig

MANIFEST = "manifest.json"


def write_manifest(config: EngineConfig, children: dict[str, subprocess.Popen]) -> None:
    sockets = []
    for entry in ipc.SOCKET_TABLE:
        names = (
            [entry["name"].format(rank=r) for r in range(config.tensor_parallel_size)]
            if "{rank}" in entry["name"]
            else [entry["name"]]
        )
        for name in names:
            sockets.append({**entry, "name": name, "address": ipc.address(config.run_dir, name)})
    manifest = {
        "launcher_pid": os.getpid(),
        "started": time.time(),
        "run_dir": config.run_dir,
        "model": config.served_model_name,
        "model_path": config.model_path,
        "http": f"http://{config.host}:{config.port}",
        "processes": [
            {"name": f"pegainfer::{name}", "pid": proc.pid} for name, proc in children.items()
        ],
        "sockets": sockets,
    }
    path = os.path.join(config.run_dir, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, path)


def read_manifest(run_dir: str) -> dict:
    with open(os.path.join(run_dir, MANIFEST)) as f:
        return json.load(f)
