#!/usr/bin/env bash
# The pod network of paratrain's kind nodes, one agent per node (what kindnetd does; its Go module is not served
# by the module proxy, so it cannot be built here): every kind node sits on one Docker network, so a pod on another
# node is reached by a route to that node's pod CIDR through the node's address. The agent
#   - writes this node's CNI configuration (ptp veths, host-local addresses from the node's pod CIDR),
#   - keeps a route to every other node's pod CIDR,
#   - masquerades pod traffic that leaves the pod network (the cluster's pod subnet, $POD_SUBNET).
# It reaches the API server at $CONTROL_PLANE_ENDPOINT (kind adds it), not through the Service address, which
# kube-proxy may not have programmed yet. NetworkPolicy is enforced beside it by kube-network-policies.
set -uo pipefail
: "${NODE_NAME:?}" "${POD_SUBNET:?}"
if [[ -n "${CONTROL_PLANE_ENDPOINT:-}" ]]; then
  export KUBERNETES_SERVICE_HOST="${CONTROL_PLANE_ENDPOINT%:*}" KUBERNETES_SERVICE_PORT="${CONTROL_PLANE_ENDPOINT##*:}"
fi
CONF=/etc/cni/net.d/10-kindnet.conflist

write_conf() {  # write_conf POD_CIDR: the node's CNI configuration, replaced in one rename when it changes
  local want
  want="$(printf '{"cniVersion": "1.0.0", "name": "kindnet", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": %s,
   "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state", "routes": [{"dst": "0.0.0.0/0"}],
            "ranges": [[{"subnet": "%s"}]]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}' "$(cat /sys/class/net/eth0/mtu)" "$1")"
  [[ "$(cat "$CONF" 2>/dev/null)" == "$want" ]] && return 0
  printf '%s\n' "$want" > "$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  echo "network-agent: CNI configuration for pod CIDR $1 written"
}

rule=(POSTROUTING -s "$POD_SUBNET" ! -d "$POD_SUBNET" -m comment --comment "kind pod egress" -j MASQUERADE)
sysctl -qw net.ipv4.ip_forward=1
declare -A routed=()
while true; do
  if nodes="$(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.podCIDR}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')"; then
    while read -r name cidr address; do
      [[ -n "$cidr" && -n "$address" ]] || continue
      if [[ "$name" == "$NODE_NAME" ]]; then
        write_conf "$cidr"
      elif [[ "${routed[$cidr]:-}" != "$address" ]]; then
        ip route replace "$cidr" via "$address" && routed[$cidr]="$address" \
          && echo "network-agent: route to $name's pods $cidr via $address"
      fi
    done <<< "$nodes"
    iptables -t nat -C "${rule[@]}" 2>/dev/null || iptables -t nat -A "${rule[@]}"
  fi
  sleep 5
done
