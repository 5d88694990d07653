"""The local service's processes by role, and the Ray node each belongs to, read from the process table.

Ray names its worker processes after the actor they host (`ray::ServeReplica:<app>:<deployment>`); a vLLM engine
runs in processes titled `VLLM::...`; every worker is a descendant of its node's raylet, whose command line carries
`--node_id`. Used by the node-loss test (which node to kill, what went with it) and jobs/bench/soak.py (RSS per process
over time).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

ROLES = {
    "CompactionIngress": "ingress",
    "Coordinator": "coordinator",
    "LLMServer": "replica",
    "ServeController": "controller",
    "ProxyActor": "proxy",
}


@dataclass(frozen=True)
class ServiceProcess:
    pid: int
    role: str  # ingress, coordinator, replica, engine (a replica's vLLM child), controller, proxy
    node_id: str | None  # the Ray node (hex id of the raylet it descends from); None when not found
    name: str  # the process title, shortened


def role_of(title: str) -> str | None:
    if title.startswith("VLLM"):  # VLLM::EngineCore, VLLM::Worker: a replica's engine processes
        return "engine"
    if not title.startswith("ray::"):
        return None
    for marker, role in ROLES.items():
        if marker in title:
            return role
    return None


def title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def raylet_of(node_id: str) -> psutil.Process | None:
    """The raylet process of a node (its executable is named `raylet`, its command line has `--node_id`)."""
    for proc in psutil.process_iter():
        if f"--node_id={node_id}" in title(proc).split():
            return proc
    return None


def raylet_node(proc: psutil.Process) -> str | None:
    """The node id of the raylet `proc` descends from."""
    try:
        for parent in proc.parents():
            if parent.name() == "raylet":
                for arg in title(parent).split():
                    if arg.startswith("--node_id="):
                        return arg.split("=", 1)[1]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return None


def service_processes() -> list[ServiceProcess]:
    """Every live process of the service on this machine: Serve's actors and the models' engine processes."""
    found: list[ServiceProcess] = []
    for proc in psutil.process_iter():
        line = title(proc)
        role = role_of(line)
        if role is not None:
            found.append(ServiceProcess(proc.pid, role, raylet_node(proc), line.split()[0][:80]))
    return found


def rss_bytes(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
