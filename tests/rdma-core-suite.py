#!/usr/bin/env python3
"""Runs rdma-core's own test suite (the pyverbs tests Debian's python3-pyverbs ships, unpacked
into SUITE_DIR) the way its run_tests.py does, and ends with one line per test case:
"RESULT <outcome> <test id>", outcome one of pass, fail, error, skip; a case that failed or
erred also gets "REASON <test id> <the exception, on one line>".

usage: rdma-core-suite.py SUITE_DIR --dev DEVICE [--gid INDEX] [TEST ...]
"""
import os
import sys
import traceback
import unittest
from importlib.machinery import SourceFileLoader

suite_dir = sys.argv[1]
# The suite's modules import args_parser from their own folder, as run_tests.py finds it.
sys.path.insert(0, suite_dir)
sys.argv = [sys.argv[0]] + sys.argv[2:]
from args_parser import parser  # noqa: E402

parser.parse_args()
tests = SourceFileLoader("tests", os.path.join(suite_dir, "__init__.py")).load_module()


class Recorded(unittest.TextTestResult):
    """Remembers every case's outcome, besides printing as unittest does."""

    outcomes = []
    reasons = {}

    def remember_reason(self, test, err):
        kind, value, _ = err
        reason = "".join(traceback.format_exception_only(kind, value)).strip()
        self.reasons[test.id()] = " ".join(reason.split())

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes.append(("pass", test.id()))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.remember_reason(test, err)
        self.outcomes.append(("fail", test.id()))

    def addError(self, test, err):
        super().addError(test, err)
        self.remember_reason(test, err)
        self.outcomes.append(("error", test.id()))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes.append(("skip", test.id()))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcomes.append(("pass", test.id()))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcomes.append(("fail", test.id()))


runner = unittest.TextTestRunner(resultclass=Recorded, verbosity=2)
unittest.main(module=tests, testRunner=runner, exit=False)
sys.stdout.flush()
for outcome, test in Recorded.outcomes:
    print(f"RESULT {outcome} {test}")
for test, reason in Recorded.reasons.items():
    print(f"REASON {test} {reason}")
