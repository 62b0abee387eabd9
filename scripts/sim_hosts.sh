#!/bin/sh
# Simulated hosts on this machine (network, UTS, mount and PID namespaces;
# see tests/_netns.py). As root:
#   scripts/sim_hosts.sh 3                      # print how to enter each host, Ctrl-C tears down
#   scripts/sim_hosts.sh 2 --rate 1gbit -- .venv/bin/torchrun --nnodes {nhosts} --node-rank {rank} \
#       --nproc-per-node 2 --master-addr {master} --master-port 29500 examples/allreduce.py
# The command runs on every host at once ({rank}, {nhosts}, {addr}, {hostname},
# {master} replaced per host); the exit code is the highest of theirs.
exec python3 "$(dirname "$0")/../tests/_netns.py" "$@"
