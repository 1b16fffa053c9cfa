"""Upstream: tensorrt_llm/version.py (`__version__`). The fake runs as the version FAKE_TRTLLM_VERSION names
(default: the release of hpc's base field table); what differs between versions is read from
hpc/data/trtllm-versions.json (see disaggregated_params.py)."""

import os

__version__ = os.environ.get("FAKE_TRTLLM_VERSION", "1.3.0rc27") + "+hpcfake"
