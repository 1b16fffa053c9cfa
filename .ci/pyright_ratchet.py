"""Types in CI, as a ratchet: pyright (pyproject's [tool.pyright]) may report no file more errors of a rule than
.ci/pyright-baseline.json records. The baseline is the debt found when pyright came in; it may only shrink.

  python .ci/pyright_ratchet.py            check (CI); exit 1 on a new error, naming it
  python .ci/pyright_ratchet.py --update   write the baseline from today's errors (only after fixing some)
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / ".ci" / "pyright-baseline.json"


def errors() -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "pyright", "--outputjson"], cwd=ROOT, capture_output=True, text=True)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        sys.exit(f"pyright gave no report (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return [d for d in report["generalDiagnostics"] if d["severity"] == "error"]


def counts(found: list[dict]) -> dict[str, dict[str, int]]:
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for d in found:
        by_file[str(Path(d["file"]).resolve().relative_to(ROOT))][d.get("rule", "error")] += 1
    return {path: dict(sorted(rules.items())) for path, rules in sorted(by_file.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true")
    args = parser.parse_args()
    found = errors()
    now = counts(found)
    if args.update:
        BASELINE.write_text(json.dumps(now, indent=1) + "\n")
        print(f"pyright baseline: {sum(map(sum, (r.values() for r in now.values())))} errors in {len(now)} files")
        return 0
    allowed = json.loads(BASELINE.read_text())
    over = [(path, rule, n, allowed.get(path, {}).get(rule, 0)) for path, rules in now.items()
            for rule, n in rules.items() if n > allowed.get(path, {}).get(rule, 0)]
    for path, rule, n, was in over:
        print(f"{path}: {n} {rule} errors, the baseline allows {was}:")
        for d in found:
            if str(Path(d["file"]).resolve().relative_to(ROOT)) == path and d.get("rule", "error") == rule:
                print(f"  {path}:{d['range']['start']['line'] + 1}: {d['message'].splitlines()[0]}")
    total, baseline = sum(sum(r.values()) for r in now.values()), sum(sum(r.values()) for r in allowed.values())
    print(f"pyright: {total} errors, baseline {baseline}" + (f"; {len(over)} files x rules over it" if over else ""))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
