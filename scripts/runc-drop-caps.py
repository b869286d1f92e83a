#!/usr/bin/env python3
"""runc, minus capabilities this sandbox cannot grant: Docker's runtime where the capability bounding set lacks some
(scripts/docker.sh decides). A privileged container (kind's nodes) asks for every capability; runc then fails with
"unable to apply caps: operation not permitted". This removes the missing ones from the OCI spec runc is about to
use — the bundle's config.json on `create`/`run`, the `--process` file on `exec` — and hands over to runc with the
same arguments.

    runc-drop-caps.py --runc=/usr/sbin/runc --drop=24[,N...] RUNC-ARGS...
"""

import json
import os
import sys

# Capability numbers (linux/capability.h) as OCI specs name them.
NAMES = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
         "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
         "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
         "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
         "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
         "CHECKPOINT_RESTORE"]


def option(args: list[str], *names: str) -> str | None:
    """The value of the first of `names` in `args` (`--name VALUE` or `--name=VALUE`)."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def drop(capabilities: dict, missing: set[str]) -> bool:
    changed = False
    for kind, caps in capabilities.items():
        kept = [c for c in caps if c not in missing]
        changed |= len(kept) != len(caps)
        capabilities[kind] = kept
    return changed


def rewrite(path: str, process_of, missing: set[str]) -> None:
    with open(path) as f:
        spec = json.load(f)
    capabilities = process_of(spec).get("capabilities")
    if capabilities and drop(capabilities, missing):
        with open(path, "w") as f:
            json.dump(spec, f)


def main(argv: list[str]) -> None:
    runc = option(argv, "--runc")
    missing = {f"CAP_{NAMES[int(n)]}" for n in (option(argv, "--drop") or "").split(",") if n}
    args = [a for a in argv if not a.startswith(("--runc=", "--drop="))]
    command = next((a for a in args if a in ("create", "run", "exec")), None)
    if command in ("create", "run"):
        bundle = option(args, "--bundle", "-b") or "."
        rewrite(os.path.join(bundle, "config.json"), lambda spec: spec.get("process", {}), missing)
    elif command == "exec" and (process := option(args, "--process", "-p")):
        rewrite(process, lambda spec: spec, missing)
    os.execv(runc, [runc, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
