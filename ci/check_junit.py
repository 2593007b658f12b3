#!/usr/bin/env python3
"""Fails unless a JUnit report shows real, executed tests: at least --min-tests, none skipped,
none failed or errored. Used by CI so that an RDMA or vLLM tier that silently skipped is not a pass."""
import argparse
import sys
import xml.etree.ElementTree as ET


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+", metavar="report", help="JUnit XML files of one tier (counted together)")
    ap.add_argument("--min-tests", type=int, default=1)
    ap.add_argument("--require", action="append", default=[], metavar="MODULE",
                    help="a test module (classname prefix, e.g. tests.rdma.test_hixl_engine) that must have run")
    a = ap.parse_args()
    roots = []
    for report in a.reports:
        try:
            roots.append(ET.parse(report).getroot())
        except (OSError, ET.ParseError) as e:
            print(f"[ci] ERROR: no usable JUnit report {report}: {e}")
            return 1
    suites = [s for root in roots for s in ([root] if root.tag == "testsuite" else root.findall("testsuite"))]
    cases = [c for root in roots for c in root.iter("testcase")]
    total = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    print(f"[ci] {' + '.join(a.reports)}: {total} tests, {skipped} skipped, {failed} failed/errored")
    if total < a.min_tests:
        print(f"[ci] ERROR: expected at least {a.min_tests} tests to run, got {total}")
        return 1
    if skipped:
        names = [c.get("name") for c in cases if c.find("skipped") is not None]
        print(f"[ci] ERROR: {skipped} test(s) were skipped, which CI counts as failure: {names[:10]}")
        return 1
    ran = {c.get("classname", "") for c in cases}
    for mod in a.require:
        if not any(c == mod or c.startswith(mod + ".") for c in ran):
            print(f"[ci] ERROR: no test of {mod} ran")
            return 1
    if failed:
        for c in cases:
            bad = c.find("failure")
            bad = bad if bad is not None else c.find("error")
            if bad is not None:
                why = (bad.get("message") or "").strip().splitlines()
                print(f"[ci] FAILED {c.get('classname')}::{c.get('name')}: {why[0][:300] if why else '(no message)'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
