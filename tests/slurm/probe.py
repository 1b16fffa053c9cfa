#!/usr/bin/env python3
"""Stands in for python in a rendered job: records where each step task ran, then exits.

Called as `probe.py -m MODULE MANIFEST [ARGS...]`; writes probe/<component>.<procid>.json next to the
manifest. A component named in the file probe/fail exits with status 3.
"""

import json
import os
import socket
import sys

module, manifest, rest = sys.argv[2], sys.argv[3], sys.argv[4:]
short = module.rsplit(".", 1)[1]
if short == "worker":
    name = f"{rest[1]}-{rest[3]}"
elif short == "infra":
    name = rest[1]
else:
    name = short
out = os.path.join(os.path.dirname(manifest), "probe")
os.makedirs(out, exist_ok=True)
record = {"component": name, "host": socket.gethostname(), "procid": os.environ.get("SLURM_PROCID"),
          "localid": os.environ.get("SLURM_LOCALID"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
          "ntasks": os.environ.get("SLURM_NTASKS"), "step": os.environ.get("SLURM_STEP_ID")}
with open(os.path.join(out, f"{name}.{record['procid']}.json"), "w") as handle:
    json.dump(record, handle)
fail = os.path.join(out, "fail")
if os.path.exists(fail) and open(fail).read().strip() == name:
    sys.exit(3)
