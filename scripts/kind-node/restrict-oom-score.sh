#!/bin/sh
# Run before containerd starts on a kind node (a drop-in's ExecStartPre). Lowering a process's oom_score_adj needs
# CAP_SYS_RESOURCE; where the node's capability bounding set lacks it (a sandboxed Docker, see scripts/docker.sh),
# runc cannot give pods the negative scores the kubelet asks for and every pod fails to start ("failed to update
# /proc/self/oom_score_adj: Permission denied"). There containerd is told to keep scores at or above its own
# (restrict_oom_score_adj, as for rootless nodes); elsewhere nothing changes.
bounding="$(awk '/^CapBnd:/ {print $2}' /proc/self/status)"
if [ $(( (0x$bounding >> 24) & 1 )) -eq 0 ]; then
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
  echo "restrict-oom-score: no CAP_SYS_RESOURCE in the bounding set; containerd restricts oom_score_adj"
fi
