#!/usr/bin/env bash
# link_cut.sh <multirank_tests>: two virtual nodes of two ranks in two network namespaces joined by a veth
# pair; the link is cut during a round of dispatch + combine. Passes when every rank fails naming a peer and
# exits within the deadline, and nothing is left in /dev/shm. Exit 77 (skipped) where namespaces cannot be
# made (not root, or a sandbox without CAP_NET_ADMIN).
set -u
bin=$1
deadline_s=${EPCOMM_LINK_CUT_TIMEOUT_S:-5}
id=$$
na=epcA$id nb=epcB$id va=epva$id vb=epvb$id
net=10.$((id % 200 + 20)).$((id / 200 % 250)).0
ip_a=${net%.0}.1 ip_b=${net%.0}.2
port=$((20000 + id % 20000))
marker=$(mktemp -u /tmp/epcomm-linkcut-XXXXXX)

cleanup() {
  ip netns del "$na" 2>/dev/null
  ip netns del "$nb" 2>/dev/null
  rm -f "$marker"
}
trap cleanup EXIT
if ! ip netns add "$na" 2>/dev/null; then
  echo "skipped: cannot create network namespaces here (needs root and CAP_NET_ADMIN)"
  exit 77
fi
ip netns add "$nb" || exit 77
ip link add "$va" type veth peer name "$vb" || { echo "skipped: cannot create a veth pair"; exit 77; }
ip link set "$va" netns "$na" && ip link set "$vb" netns "$nb" || exit 1
ip -n "$na" addr add "$ip_a/24" dev "$va" && ip -n "$nb" addr add "$ip_b/24" dev "$vb" || exit 1
for ns in "$na" "$nb"; do ip -n "$ns" link set lo up; done
ip -n "$na" link set "$va" up && ip -n "$nb" link set "$vb" up || exit 1

export EPCOMM_RANKS_PER_NODE=2 UCX_TLS=tcp EPCOMM_TIMEOUT_S=$deadline_s EPCOMM_TEST_MARKER=$marker
shm_names() { ls /dev/shm | grep '^epcomm-' | sort || true; }
shm_before=$(shm_names)
pids=()
for r in 0 1 2 3; do
  if [ $r -lt 2 ]; then ns=$na dev=$va; else ns=$nb dev=$vb; fi
  ip netns exec "$ns" env UCX_NET_DEVICES="$dev" "$bin" --case internode_link_cut --launcher tcp --np 4 \
    --rank $r --endpoint "tcp://$ip_a:$port" &
  pids+=($!)
done

for _ in $(seq 600); do [ -e "$marker" ] && break; sleep 0.1; done
if [ ! -e "$marker" ]; then
  echo "FAIL: the first round did not finish within 60 s"
  kill -9 "${pids[@]}" 2>/dev/null
  exit 1
fi
cut_at=$(date +%s%N)
ip -n "$na" link set "$va" down
echo "link cut at $(date +%T.%N)"

rc=0
limit=$((3 * deadline_s + 15))  # the op deadline, then teardown (bounded by the same deadline), with slack
for i in "${!pids[@]}"; do
  pid=${pids[$i]}
  for _ in $(seq $((limit * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "FAIL: rank $i still running ${limit} s after the cut"
    kill -9 "$pid"
    rc=1
  fi
  wait "$pid" || { echo "FAIL: rank $i exited with $?"; rc=1; }
done
elapsed_ms=$((($(date +%s%N) - cut_at) / 1000000))
echo "every rank done ${elapsed_ms} ms after the cut (deadline ${deadline_s} s)"
# Entries that were not there before and are still there a moment later (another process's segments exist
# only while its ranks map them).
new_now=$(comm -13 <(echo "$shm_before") <(shm_names))
sleep 2
left=$(comm -12 <(echo "$new_now") <(comm -13 <(echo "$shm_before") <(shm_names)) | grep -c . || true)
if [ "$left" -gt 0 ]; then
  echo "FAIL: $left epcomm entries left in /dev/shm:"
  comm -12 <(echo "$new_now") <(comm -13 <(echo "$shm_before") <(shm_names))
  rc=1
fi
[ $rc -eq 0 ] && echo "PASS internode_link_cut"
exit $rc
