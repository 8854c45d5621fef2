"""`make security-check`: run the attack tests (issue 35) and print each attack as HELD or NOT HELD.

A passed test is an attack that failed (HELD); an xfailed one is an attack that still succeeds, marked
so with its reason (NOT HELD); a failed or errored one is NOT HELD too (a regression, or a fix whose
xfail mark is stale); a skipped one names why (e.g. not root, so no attacker as user nobody).
`make test` runs the same files as part of the whole suite; this target is for the table.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ATTACK_GLOBS = (
    "tests/**/test_join_secret*.py",
    "tests/**/test_http_limits*.py",
    "tests/integration/test_security.py",
    "tests/integration/test_security_attacks.py",
    "tests/unit/disagg/test_kv_store_records.py",
    "tests/integration/test_transfer_security.py",
    "tests/unit/common/test_member_certificates.py",
)


def attack_files() -> list[str]:
    return sorted({str(p.relative_to(ROOT)) for pattern in ATTACK_GLOBS for p in ROOT.glob(pattern)})


def verdict(case: ET.Element) -> tuple[str, str]:
    """(HELD | NOT HELD | SKIPPED, why) of one junit testcase."""
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            message = (found.get("message") or tag).splitlines()
            return "NOT HELD", (message[0] if message else tag)[:100]
    skipped = case.find("skipped")
    if skipped is None:
        return "HELD", ""
    message = skipped.get("message") or ""
    if skipped.get("type") == "pytest.xfail":
        return "NOT HELD", message.removeprefix("xfail").strip(" -:")[:100]
    return "SKIPPED", message[:100]


def main() -> int:
    files = attack_files()
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "attacks.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
        run = subprocess.run(command, cwd=ROOT)
        cases = ET.parse(report).getroot().iter("testcase")
        rows = [(f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}", *verdict(c)) for c in cases]
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'attack (test)':<{width}}  verdict   why")
    for name, outcome, why in rows:
        print(f"{name:<{width}}  {outcome:<8}  {why}")
    counts = {v: sum(1 for _, o, _ in rows if o == v) for v in ("HELD", "NOT HELD", "SKIPPED")}
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    return run.returncode  # 0 while every attack is held or a known, marked NOT HELD


if __name__ == "__main__":
    sys.exit(main())
