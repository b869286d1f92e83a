"""The Pod Security Standard's `restricted` profile (Kubernetes 1.30), as a checker: pod → its violations.

Covers every control of the baseline and restricted levels that a pod spec can break (Windows hostProcess,
host namespaces, privileged, capabilities, hostPath, hostPorts, AppArmor, SELinux, /proc mount, seccomp, sysctls,
volume types, privilege escalation, non-root).
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every violation in a pod spec (a Pod's `spec`, or a workload's pod template `spec`), as text."""
    pod_sc = spec.get("securityContext") or {}
    out = [f"{f}: true" for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
    out += [f"volume {v['name']}: type not allowed" for v in spec.get("volumes", [])
            if not (set(v) - {"name"}) <= RESTRICTED_VOLUME_TYPES]
    out += [f"sysctl {s['name']}" for s in pod_sc.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    out += _context_violations("pod", pod_sc)
    for c in _containers(spec):
        sc = c.get("securityContext") or {}
        where = f"container {c['name']}"
        out += _context_violations(where, sc)
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{where}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {caps['add']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount")
        out += [f"{where}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
        if not _effective(sc, pod_sc, "runAsNonRoot"):
            out.append(f"{where}: runAsNonRoot must be true")
        if (_effective(sc, pod_sc, "seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost")
    return out


def _effective(container_sc: dict[str, Any], pod_sc: dict[str, Any], field: str) -> Any:
    return container_sc[field] if field in container_sc else pod_sc.get(field)


def _context_violations(where: str, sc: dict[str, Any]) -> list[str]:
    out = []
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}: hostProcess")
    if sc.get("runAsUser") == 0:
        out.append(f"{where}: runAsUser: 0")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}: seccomp Unconfined")
    if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"{where}: appArmorProfile")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        out.append(f"{where}: seLinuxOptions")
    return out
