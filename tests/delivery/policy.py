"""Checks for what the cluster would enforce: the restricted Pod Security Standard and least-privilege RBAC.

`restricted_violations` follows https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline
and restricted controls, latest version); it returns every violation as text, so a failing test names them all.
"""

from __future__ import annotations

from typing import Any, Iterator

# Restricted: the only volume types a pod may use.
ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                        "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of `kind`; fails when there are none or several."""
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}: {[o['kind'] for o in objects]}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod spec) of every Pod and of every workload's pod template."""
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Pod":
            yield name, obj["spec"]
        elif obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
            yield name, obj["spec"]["template"]["spec"]


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key}: true")
    for volume in spec.get("volumes", []):
        types = set(volume) - {"name"}
        if not types <= ALLOWED_VOLUME_TYPES:
            out.append(f"volume {volume['name']}: type {sorted(types - ALLOWED_VOLUME_TYPES)} not allowed")
    pod_sc = spec.get("securityContext", {})
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']} not allowed")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser: 0")
    out += _selinux_violations("pod", pod_sc)
    pod_seccomp = pod_sc.get("seccompProfile", {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
        out.append(f"pod seccompProfile {pod_seccomp}")
    containers = [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]
    if not containers:
        out.append("no containers")
    for c in containers:
        where = f"container {c['name']}"
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{where}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {caps['add']}")
        if sc.get("runAsNonRoot") is False or not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
            out.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser: 0")
        seccomp = sc.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_OK:
            out.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost (got {seccomp})")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {sc['procMount']}")
        out += _selinux_violations(where, sc)
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
    return out


def _selinux_violations(where: str, sc: dict[str, Any]) -> list[str]:
    opts = sc.get("seLinuxOptions", {})
    out = []
    if opts.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t",
                                "container_engine_t"):
        out.append(f"{where}: seLinuxOptions.type {opts['type']}")
    if opts.get("user") or opts.get("role"):
        out.append(f"{where}: seLinuxOptions user/role set")
    return out


def rbac_wildcards(rules: list[dict[str, Any]]) -> list[str]:
    """Every `*` in apiGroups, resources, verbs or resourceNames, and any nonResourceURLs."""
    out = []
    for i, rule in enumerate(rules):
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            if any("*" in item for item in rule.get(field, [])):
                out.append(f"rules[{i}].{field}: {rule[field]}")
        if rule.get("nonResourceURLs"):
            out.append(f"rules[{i}].nonResourceURLs: {rule['nonResourceURLs']}")
    return out


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """The (apiGroup, resource, verb) triples the rules grant."""
    return {(g, r, v) for rule in rules for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
            for v in rule.get("verbs", [])}
