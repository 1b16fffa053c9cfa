"""How a component's log lines look: text (the default) or one JSON object a line (`runtime.log_format: json`), at
the recipe's `runtime.log_level`, which TensorRT-LLM's own logger takes too (TLLM_LOG_LEVEL)."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# tensorrt_llm/logger.py's severities, by TLLM_LOG_LEVEL
TLLM_LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR"}
# the ids the frontend gives requests (the response's id, x-request-id): what a log stack indexes a line by
REQUEST_ID = re.compile(r"\b(?:chatcmpl|cmpl|video)-[0-9A-Za-z]{8,}(?:-[0-9]+)?\b")


class JsonLines(logging.Formatter):
    """One JSON object a line: time, level, run, component, logger, message, and the request it names."""

    def __init__(self, run: str, component: str) -> None:
        super().__init__()
        self.run, self.component = run, component

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "run": self.run,
                                "component": self.component, "logger": record.name, "message": message}
        found = getattr(record, "request_id", None) or (m.group(0) if (m := REQUEST_ID.search(message)) else None)
        if found:
            line["request_id"] = found
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(component: str, run: str = "", level: str = "info", form: str = "text") -> None:
    """The root logger for this process, replacing whatever was set before (a supervisor's, basicConfig's)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines(run, component) if form == "json"
                         else logging.Formatter(f"%(asctime)s {component} %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # debug is hpc's own: the libraries' (grpc, asyncio) would bury it
    root.setLevel(max(LEVELS[level], logging.INFO))
    logging.getLogger("hpc").setLevel(LEVELS[level])
    os.environ.setdefault("TLLM_LOG_LEVEL", TLLM_LEVELS[level])  # before tensorrt_llm is imported


def setup_component_logging(component: str, manifest: Any) -> None:
    runtime = manifest.recipe.runtime
    setup_logging(component, manifest.run_id, runtime.log_level, runtime.log_format)
